"""Rendering docs/seeds/000-substitution.md from bench/seed_000.py's results: the paper's claims
beside this project's measurements, then one table per experiment, and two plots. The hand-written
analysis below the generated part (from the line `## Why the results differ` on) is kept on a rerun."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.seed000_generation import generation_claim, generation_section
from bench.seed000_stats import at_share
from bench.seed_real_shape_page import claim_row, section

KEEP_FROM = "\n## Why the results differ"
QUALITY_COLS = (
    "| policy | PPL | ΔPPL | substituted calls | substituted mass / token-layer | fetches / token | admissions |",
    "|---|---|---|---|---|---|---|",
)


def pct(x: float) -> str:
    return f"{x:+.2f} %"


def quality_row(r: dict[str, Any], label: str | None = None) -> str:
    return (
        f"| {label or r['label']} | {r['ppl']:.2f} | {pct(r['delta_ppl_pct'])} | {r['substitution_share']:.1%} | "
        f"{r['mean_substituted_mass']:.3f} | {r['fetches_per_token']:.2f} | {r['admissions']} |"
    )


def by_label(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in rows}


def matched(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The unprotected rule's ΔPPL at the protected rule's share: interpolated between the two tries
    that bracket it, else the nearest try."""
    target = tries[0]["target_share"]
    inter = at_share(tries, target)
    if inter is not None:
        return {"share": target, "delta_ppl_pct": inter, "interpolated": True}
    near = min(tries, key=lambda r: abs(r["substitution_share"] - target))
    return {
        "share": near["substitution_share"],
        "delta_ppl_pct": near["delta_ppl_pct"],
        "interpolated": False,
    }


def lower_shares(d: dict[str, Any]) -> str:
    """The claims table's contrast at the other protected cutoffs: each rule's share, its ΔPPL, the
    unprotected rule's at that share."""
    prot = {**d.get("contrast_protected", {}), **by_label(d["table"])}
    parts = []
    for label, tries in d["contrast"].items():
        if label != "threshold":
            m = matched(tries)
            parts.append(
                f"{label} at {m['share']:.1%}: protected {pct(prot[label]['delta_ppl_pct'])}, unprotected {pct(m['delta_ppl_pct'])}"
            )
    return ("; " + "; ".join(parts)) if parts else ""


def claims(d: dict[str, Any]) -> list[str]:
    t, m = by_label(d["table"]), d["mass"]
    thr, qf, sf = t["threshold"], t["quality-first"], t["speed-first"]
    match = matched(d["contrast"]["threshold"])
    b2 = d["experiment_b"][0]
    heavy, light = b2["heavy"], b2["light"]
    adm = {(r["eviction"], r["admission"]): r for r in d["admission"]["threshold"]}
    shift = d["shift"]["rows"]
    after = [r for r in shift if r["part"].startswith("first")]
    tf, gen = (by_label(d["speed"].get(w, [])) for w in ("teacher-forced", "generate"))
    pj = by_label(d["projected"])

    def speed(label: str) -> str:
        if label not in tf:
            return "not run"
        g = f", {gen[label]['vs_fetch_all']:.2f}× generating" if label in gen else ""
        return f"{tf[label]['vs_fetch_all']:.2f}× teacher-forced{g}"

    def sf_over_thr(rows: dict[str, dict[str, Any]]) -> str:
        return f"{rows['speed-first']['vs_fetch_all'] / rows['threshold']['vs_fetch_all']:.2f}×"

    def gain(label: str) -> float:
        return 100 * (t[label]["ppl"] / thr["ppl"] - 1)

    admit_after = {r["label"]: r for r in after}
    return [
        "| the paper's claim (Qwen3-Next-80B-A3B, RTX 3090) | paper | here (embedded model, teacher-forced; speed: measured / PROJECTED) | section |",
        "|---|---|---|---|",
        f"| presets vs fetch-all: speed, quality | 2.5-3.0× faster at +0.7-1.5 % PPL | QF {speed('quality-first')} / SF {speed('speed-first')} measured "
        f"({d['args']['link']} link); PROJECTED {pj['quality-first']['vs_fetch_all']:.2f}× / {pj['speed-first']['vs_fetch_all']:.2f}×; "
        f"QF {pct(qf['delta_ppl_pct'])}, SF {pct(sf['delta_ppl_pct'])} | 1, 7 |",
        f"| the 0.15 rule substitutes 7.5 % of calls at +0.35 % | 7.5 %, +0.35 % | {thr['substitution_share']:.1%}, {pct(thr['delta_ppl_pct'])} | 1 |",
        f"| no protection at a similar share costs far more | 8.5 %, +5.67 % | {match['share']:.1%} "
        f"({'interpolated between two runs' if match['interpolated'] else 'the nearest run'}), {pct(match['delta_ppl_pct'])}"
        f"{lower_shares(d)} | 2 |",
        f"| experiment B: few heavy cost more than many light, equal mass | heavy > light (inconclusive by its rule) | 2nd choice: heavy {pct(heavy['delta_ppl_pct'])} at mass "
        f"{heavy['mean_substituted_mass']:.4f}, light {pct(light['delta_ppl_pct'])} at {light['mean_substituted_mass']:.4f}; "
        f"1st choice: heavy {pct(d['experiment_b'][1]['heavy']['delta_ppl_pct'])}, light {pct(d['experiment_b'][1]['light']['delta_ppl_pct'])} | 3 |",
        f"| background admission lowers PPL 0.3-1.5 %, most after a topic shift | -0.3 to -1.5 % | threshold + background vs threshold: "
        f"{100 * (adm[('reuse', 'background')]['ppl'] / adm[('reuse', 'none')]['ppl'] - 1):+.2f} %; right after the shift "
        f"{admit_after['threshold + background']['delta_ppl_pct'] - admit_after['threshold']['delta_ppl_pct']:+.2f} pt | 4, 5 |",
        f"| mass hypothesis across first-choice-protecting policies | r ≈ 0.92 | r = {m['r_protecting']:.3f} over {m['n_protecting']} policies; "
        f"{m['r_best_resident']:.3f} over the {m['n_best_resident']} with the router's stand-in; median within one window {m['within_input_r_median']:.3f} | 6 |",
        f"| Quality-First vs the 0.15 rule: PPL | 0.5-0.8 % lower | {gain('quality-first'):+.2f} % | 1, 4 |",
        "| Speed-First vs the 0.15 rule: time | about 5 % faster, no significant PPL cost | measured "
        + (f"{sf_over_thr(tf)} teacher-forced" if tf else "not run")
        + (f", {sf_over_thr(gen)} generating" if gen else "")
        + f" (ratio of the two × fetch-all), PROJECTED {pj['speed-first']['tok_s'] / pj['threshold']['tok_s']:.2f}×; PPL {gain('speed-first'):+.2f} % | 7 |",
        llama_claim(d),
        generation_claim(d),
    ]


def llama_claim(d: dict[str, Any]) -> str:
    """The last claim's row: the engine against llama-server at equal memory (section 8)."""
    lead = "| the 0.15-rule engine vs stock llama.cpp at equal VRAM | 2.8-3.0× at +1.6 % PPL | "
    ll = d.get("llama")
    if not ll:
        return lead + "not run (`--llama-cpp DIR`; see below) | – |"
    sp, t = {r["system"]: r for r in ll["speed"]}, by_label(d["table"])
    free = next(r for n, r in sp.items() if n.startswith("llama") and "whole" in n)
    ppl = ll["ppl"]
    return (
        lead
        + "MEASURED, RAM as the fast tier, the same memory for weights (dense + 25 % of the experts), the "
        f"rest read from disk: the 0.15 rule {sp['threshold']['vs_llama_limited']:.1f}× llama-server (Quality-First "
        f"{sp['quality-first']['vs_llama_limited']:.1f}×, Speed-First {sp['speed-first']['vs_llama_limited']:.1f}×, "
        f"the exact fetch-all {sp['fetch-all']['vs_llama_limited']:.1f}×) at {pct(t['threshold']['delta_ppl_pct'])} PPL "
        f"(section 1); llama.cpp's PPL {pct(100 * (ppl['llama.cpp'] / ppl['engine']['fetch-all'] - 1))} from the exact "
        f"engine's on {ppl['tokens']} tokens; llama-server with the whole model in memory {free['vs_llama_limited']:.0f}× "
        "its limited self | 8 |"
    )


def sections(d: dict[str, Any], stem: str) -> list[str]:
    t = d["table"]
    out = ["## 1. The policy table (teacher-forced)", "", *QUALITY_COLS]
    out += [quality_row(r) for r in t if not r["label"].startswith("B:")]
    out += ["", "## 2. The protection contrast at matched substitution shares", ""]
    out += [
        "| protected rule | its share | unprotected cutoff tried | unprotected share | protected mass | unprotected mass | protected ΔPPL | unprotected ΔPPL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tb = {
        **d.get("contrast_protected", {}),
        **by_label(t),
    }  # protected rows measured apart (--only-contrast)
    for label, tries in d["contrast"].items():
        for r in tries:
            out.append(
                f"| {label} | {r['target_share']:.1%} | {r['cutoff']:.4f} | {r['substitution_share']:.1%} | "
                f"{tb[label]['mean_substituted_mass']:.3f} | {r['mean_substituted_mass']:.3f} | "
                f"{pct(tb[label]['delta_ppl_pct'])} | {pct(r['delta_ppl_pct'])} |"
            )
        m = matched(tries)
        if m["interpolated"]:
            out.append(
                f"| {label} | {m['share']:.1%} | interpolated between the tries that bracket the share | "
                f"{m['share']:.1%} | | | {pct(tb[label]['delta_ppl_pct'])} | **{pct(m['delta_ppl_pct'])}** |"
            )
    out += [
        "",
        "## 3. Experiment B: a few heavy substitutions against many light ones (EMULATION)",
        "",
    ]
    out += [
        "| heavy slot | run | ΔPPL | substituted calls | mass / token-layer | mass / substituted call | windows where heavy loses more |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in d["experiment_b"]:
        for kind in ("heavy", "light"):
            r = b[kind]
            share = r["substitution_share"]
            # mass per token-layer / substituted calls per token-layer
            per_call = (
                r["mean_substituted_mass"] / (share * int(d["model_shape"]["top_k"]))
                if share
                else 0.0
            )
            out.append(
                f"| {b['heavy_slot']} | {kind} | {pct(r['delta_ppl_pct'])} | {share:.1%} | {r['mean_substituted_mass']:.4f} | "
                f"{per_call:.3f} | "
                + (f"{b['heavy_worse_windows']} of {b['windows']}" if kind == "heavy" else "")
                + " |"
            )
    gp = d["gate_percentiles"]
    out += [
        "",
        "Normalized gate by router rank (10th / 50th / 90th percentile over the scored token-layers): "
        + "; ".join(
            f"rank {i}: {gp['10'][i]:.3f} / {gp['50'][i]:.3f} / {gp['90'][i]:.3f}"
            for i in range(len(gp["50"]))
        ),
    ]
    out += ["", "## 4. Background admission on its own (the eviction held fixed)", ""]
    for rule, cells in d["admission"].items():
        out += [
            f"**{rule}**",
            "",
            "| eviction | admission | PPL | ΔPPL | substituted calls | fetches / token | admissions |",
            "|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {c['eviction']} | {c['admission']} | {c['ppl']:.2f} | {pct(c['delta_ppl_pct'])} | {c['substitution_share']:.1%} | {c['fetches_per_token']:.2f} | {c['admissions']} |"
            for c in cells
        ]
        out.append("")
    s = d["shift"]
    out += [f"## 5. After a topic shift: {s['from']} then {s['to']}", ""]
    out += [
        "| policy | part | tokens | ΔPPL | substituted calls | admissions |",
        "|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['label']} | {r['part']} | {r['tokens']} | {pct(r['delta_ppl_pct'])} | {r['substitution_share']:.1%} | {r['admissions']} |"
        for r in s["rows"]
    ]
    out += ["", f"![ΔPPL per window across the topic shift]({stem}-shift.png)", ""]
    m = d["mass"]
    out += ["## 6. The mass hypothesis", ""]
    out += [
        f"- across the first-choice-protecting policies of section 1 (n = {m['n_protecting']}): r = **{m['r_protecting']:.3f}**",
        f"- across those with the router's stand-in, without the `/drop` rows (n = {m['n_best_resident']}): r = **{m['r_best_resident']:.3f}**",
        f"- within one input: per window, r across those policies; median over {m['within_input_n']} windows: **{m['within_input_r_median']:.3f}**",
        "- across inputs, one policy (does more mass mark the windows that lose more?): "
        + ", ".join(f"{k} r = {v:.3f}" for k, v in m["across_input_r"].items()),
        "",
        f"![ΔPPL against substituted mass]({stem}-mass.png)",
        "",
    ]
    out += speed_sections(d)
    return out + llama_section(d) + generation_section(d)


def quartiles(xs: list[float]) -> str:
    """The middle half of a cell's per-round ratios."""
    import statistics

    if len(xs) < 2:
        return "–"
    q = statistics.quantiles(sorted(xs), n=4)
    return f"{q[0]:.2f}-{q[2]:.2f}"


def llama_section(d: dict[str, Any]) -> list[str]:
    """Section 8: bench/seed000_llama.py's run (`--only-llama` merges it into the JSON as `llama`)."""
    ll = d.get("llama")
    if not ll:
        return []
    a, mem, ppl = ll["args"], ll["memory"], ll["ppl"]
    mib = 1 << 20
    disk = ", ".join(f"{v:.0f} MB/s {k}" for k, v in ll["disk_mb_s"].items())
    out = [
        "## 8. Against stock llama.cpp at equal memory",
        "",
        "Generated by `python -m bench seed-000 --llama-cpp DIR --only-llama` (bench/seed000_llama.py), a run of its own "
        f"merged into the JSON as `llama`: {ll['machine']} Run time {ll['seconds'] / 60:.1f} min; load average "
        f"{ll['load_average']:.1f} when it ended. llama.cpp: the llama-server that llama-cpp-python 0.3.36 vendors, on "
        f"the same weights as a bf16 GGUF ({mem['gguf_bytes'] / mib:.1f} MiB; llama.cpp's own converter), 1 thread, "
        "its default mmap. On this CPU-only machine RAM is the fast tier, so the paper's equal VRAM is equal memory for "
        f"weights: the engine keeps the dense weights and 25 % of the routed experts ({mem['engine_fast_tier'] / mib:.1f} "
        f"MiB of {mem['expert_bytes'] / mib:.1f}) and reads the others from the safetensors with uncached I/O; "
        "llama-server runs inside a cgroup v1 memory limit of its own anonymous memory (runtime, KV cache, compute "
        f"buffers: {mem['llama_anon'] / mib:.1f} MiB after a warm-up request) plus the same weight bytes (the GGUF less "
        f"75 % of the experts' bytes: {mem['weight_budget'] / mib:.1f} MiB) plus 2 MiB, {mem['limit'] / mib:.1f} MiB in "
        "all, so the kernel keeps that much of the GGUF's pages and reads the rest back from disk as the decode "
        "touches them. A second llama-server on a copy of the GGUF runs with no limit: the whole model in memory.",
        "",
        f"Decode: one 32-token prompt a round (a different one each round), {a['llama_tokens']} greedy tokens, prefill "
        f"excluded everywhere; medians of {a['llama_rounds']} interleaved rounds after a warm-up round on the shared "
        "2-core machine, ratios taken within a round. Bytes read from disk: the engine's counter (expert loads); "
        "llama-server's /proc/PID/io `read_bytes` (page faults and the kernel's readahead).",
        "",
        "| system | decode tok/s | × llama-server at equal memory | middle half of the rounds' ratios | MB read from disk / token | read rate, MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in ll["speed"]:
        name = r["system"] if r["system"].startswith("llama") else f"this engine, {r['system']}"
        out.append(
            f"| {name} | {r['tok_s']:.1f} | {r['vs_llama_limited']:.2f}× | {quartiles(r['round_ratios'])} | "
            f"{r['read_MB_per_token']:.3f} | {r['read_MB_per_token'] * r['tok_s']:.0f} |"
        )
    base = ppl["engine"]["fetch-all"]
    out += [
        "",
        f"Perplexity on {ppl['tokens']} tokens of `{d['data']}` ({a['llama_ppl_window']}-token windows; section 1 has "
        "every policy on the larger sample): the engine teacher-forced per policy, llama-server one token at a time "
        "(each next token's logprob from its full distribution, the prefix cached; the memory limit changes no "
        "number, so the unlimited server scored it).",
        "",
        "| system | PPL | vs the exact engine's |",
        "|---|---|---|",
        *(
            f"| this engine, {k} | {v:.2f} | {pct(100 * (v / base - 1))} |"
            for k, v in ppl["engine"].items()
        ),
        f"| llama.cpp | {ppl['llama.cpp']:.2f} | {pct(100 * (ppl['llama.cpp'] / base - 1))} |",
        "",
        f"The disk, measured in the same run with sequential reads of the model's files: {disk}. A page fault on "
        "an mmap'd file reads around the faulting page, up to the disk's read-ahead"
        + (
            f" ({ll['read_ahead_kb']:,} KiB on this machine's disk)"
            if ll.get("read_ahead_kb")
            else ""
        )
        + f". The limit llama-server meets: at {mem['limit'] / mib:.1f} MiB its faults read the column 'MB read from "
        "disk / token' again every token, at the read rate shown, against the disk's bandwidth above.",
        "",
    ]
    return out


def speed_sections(d: dict[str, Any]) -> list[str]:
    out = ["## 7. Speed", ""]
    for workload, rows in d["speed"].items():
        out += [
            f"**Measured, {workload}**: experts on disk behind the emulated `{d['args']['link']}` link, "
            f"{d['args']['speed_windows']} interleaved rounds after a warm-up round, one "
            + (
                f"{d['args']['speed_window']}-token window"
                if workload == "teacher-forced"
                else f"64-token prompt and {d['args']['speed_tokens']} greedy tokens (prefill excluded)"
            )
            + " per engine per round; medians; background loads land when the link delivers them (as in serving).",
            "",
            "| policy | tok/s | × fetch-all (same round) | stall share | hit share | fetched / step | substituted / step | MB moved / step | admissions |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['label']} | {r['tok_s']:.1f} | {r['vs_fetch_all']:.2f}× | {r['stall_share']:.0%} | {r['hit_share']:.0%} | "
            f"{r['fetched_per_step']:.2f} | {r['substituted_per_step']:.2f} | {r['MB_per_step']:.3f} | {int(r['admissions'])} |"
            for r in rows
        ]
        out.append("")
    out += [
        f"**SIMULATED + PROJECTED** ({d['args']['profile']}, {d['args']['shape']}; the router trace of section 1's tokens "
        "projected by engine/offline/projection.py and replayed by the router-trace simulator; stand-ins dropped, as bench/sim_validation.py projects them):",
        "",
        "| policy | tok/s | × fetch-all | stall share | hit share | loads / token |",
        "|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['label']} | {r['tok_s']:.1f} | {r['vs_fetch_all']:.2f}× | {r['stall_share']:.0%} | {r['hit_share']:.0%} | {r['loads_per_token']:.2f} |"
        for r in d["projected"]
    ]
    return out + [""]


def result_line(d: dict[str, Any]) -> str:
    """The page's first line: the 0.15 rule's share and cost, the presets' speed and cost, and the
    llama.cpp comparison when section 8 ran."""
    t, tf = by_label(d["table"]), by_label(d["speed"].get("teacher-forced", []))
    gen = by_label(d["speed"].get("generate", []))
    thr = t["threshold"]

    def preset(name: str, label: str) -> str:
        speed = (
            f"{tf[label]['vs_fetch_all']:.2f}× fetch-all teacher-forced"
            if label in tf
            else "speed not run"
        )
        speed += f", {gen[label]['vs_fetch_all']:.2f}× generating" if label in gen else ""
        return f"{name} {speed} at {pct(t[label]['delta_ppl_pct'])} PPL"

    ll = d.get("llama")
    tail = (
        f"; at equal memory the 0.15 rule runs {next(r for r in ll['speed'] if r['system'] == 'threshold')['vs_llama_limited']:.1f}× "
        "llama-server (section 8)"
        if ll
        else ""
    )
    return (
        f"teacher-forced, the 0.15 rule substitutes {thr['substitution_share']:.1%} of expert calls at "
        f"{pct(thr['delta_ppl_pct'])} PPL (the paper: 7.5 % at +0.35 %); {preset('Quality-First', 'quality-first')}, "
        f"{preset('Speed-First', 'speed-first')}{tail}."
    )


def contrast_command(d: dict[str, Any]) -> str:
    """The Command line's words for section 2's cutoffs: the main run's where not the default, and
    the runs of their own (`--only-contrast`) merged since."""
    main = d["args"].get("contrast_cutoffs", "0.15")
    words = f"; section 2 at cutoffs {main} (`--contrast-cutoffs {main}`)" if main != "0.15" else ""
    for cutoffs in d.get("contrast_runs", []):
        words += (
            f"; section 2's rows at cutoffs {cutoffs} are a run of their own, `python -m bench seed-000 "
            f"--only-contrast --contrast-cutoffs {cutoffs}` (bench/seed000_contrast.py), merged into the JSON"
        )
    return words


def render(d: dict[str, Any], out: Path) -> str:
    a, shape = d["args"], d["model_shape"]
    js = out.with_suffix(".json").name
    head = [
        "# Seed 000: which expert misses are worth waiting for (substitution and caching), run here",
        "",
        f"- **Result:** {result_line(d)}",
        "- **Command:** `python -m bench seed-000` (bench/seed_000.py: sections 1-7 and 9, the plots and the JSON; section 9 alone: `--only-generation`); section 8 "
        "is a run of its own, `python -m bench seed-000 --llama-cpp DIR --only-llama` (DIR: a llama.cpp source tree with "
        "build/bin/llama-server; bench/seed000_llama.py), merged into the JSON"
        + contrast_command(d)
        + "; `--render-only` rewrites the page from "
        f"the JSON; numbers in [{js}]({js}).",
        f"- **Machine:** {d['machine'].removeprefix('Machine: ')} A shared 2-core machine: quality figures are "
        "deterministic (teacher-forced, background loads settled before each layer plans, prefetch off); speed figures "
        "are ratios measured side by side in one interleaved run.",
        f"- **Limit:** the embedded model routes top-{shape['top_k']} of {shape['num_experts']} experts with flat gates "
        "(section 3's percentiles), so the 0.15 rule is nearly the first-choice rule and substitutes far more calls "
        f"than on the paper's model; speeds are a CPU's (sections 1 and 7 behind the emulated `{a['link']}` link), not a GPU's over PCIe.",
        "",
        f"Model: `{d['model']}` ({len(shape['moe_layers'])} MoE layers x {shape['num_experts']} experts, top-{shape['top_k']}). Sample: {d['tokens']} scored tokens "
        f"({d['windows']} windows of {a['window']}) spread over `{d['data']}`; cache fraction {a['cache_fraction']} "
        f"(the paper's about 25 %). Run time {d['seconds'] / 60:.1f} min. Larger samples: `--tokens`, `--shift-windows`, "
        "`--speed-windows`.",
        "",
        "## The paper's claims beside this project's measurements",
        "",
    ]
    real = section(d, "000", 10, "seed-000")
    body = head + claims(d) + claim_row(d, "000", 10) + [""] + sections(d, out.stem) + real
    old = out.read_text() if out.exists() else ""
    kept = old[old.index(KEEP_FROM) :] if KEEP_FROM in old else ""
    return "\n".join(body) + ("\n" + kept.lstrip("\n") if kept else "")


def write_plots(d: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cli.eval import _plot

    fraction = float(d["args"]["cache_fraction"])
    _plot(
        [r for r in d["table"] if not r["label"].startswith("B:")],
        out.with_name(out.stem + "-mass.png"),
        fraction,
    )
    s = d["shift"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, ys in s["per_window_delta_ppl_pct"].items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=label)
    n = int(d["args"]["shift_windows"])
    ax.axvline(n + 0.5, color="grey", linestyle="--")
    ax.set_xlabel(f"window ({d['args']['shift_window']} tokens); {s['from']} | {s['to']}")
    ax.set_ylabel("ΔPPL vs fetch-all (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_name(out.stem + "-shift.png"), dpi=130)
    plt.close(fig)
