"""Rendering docs/seeds/003-specprefetch.md from bench/seed_003.py's results: the paper's claims
beside this project's measurements, the recall table, the measured and simulated speed tables and
the bandwidth-sweep plot. The hand-written analysis below the generated part (from the line
`## Why the results differ` on) is kept on a rerun."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.seed_real_shape_page import claim_row, section

KEEP_FROM = "\n## Why the results differ"
NONE = "no prefetch"


def short(name: str) -> str:
    """A predictor's short label: the words before its parenthesis."""
    return name.split(" (")[0] + (" plain" if "paper's form" in name else "")


def by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["predictor"]: r for r in rows}


def find(rows: list[dict[str, Any]], **match: str) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def ratio(rows: list[dict[str, Any]], **match: str) -> str:
    r = find(rows, **match)
    return f"{r['vs_none']:.2f}×" if r is not None else "not run"


def spread(r: dict[str, Any]) -> str:
    """The middle half (quartiles) of a cell's per-round ratios to no prefetch."""
    xs = sorted(r.get("round_ratios") or [])
    if len(xs) < 2:
        return "–"
    q = statistics.quantiles(xs, n=4)
    return f"{q[0]:.2f}-{q[2]:.2f}"


def speed_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured rows: the full run's, and the draft model's from an `--only-draft` run (marked
    run 2; their ratios are to that run's own no-prefetch cells) where the full run has none."""
    rows = list(d["speed"])
    extra = (d.get("draft_run") or {}).get("speed") or []
    have = {r["predictor"] for r in rows}
    return rows + [
        {**r, "run": 2} for r in extra if r["predictor"] not in have and "draft" in r["predictor"]
    ]


def names(d: dict[str, Any]) -> dict[str, str]:
    """role -> the predictor's full name, found by its leading words."""
    out = {}
    for r in d["rows"]:
        n = r["predictor"]
        role = (
            "plain"
            if "paper's form" in n
            else "shipped"
            if n.startswith("SpecPrefetch")
            else n.split(" ")[0].split("-")[0].lower()
        )
        out[role] = n
    return out


def claims(d: dict[str, Any]) -> list[str]:
    n, rec = names(d), by_name(d["rows"])
    link = d["args"]["link"]
    sp, sim = speed_rows(d), d["simulated"]
    slow = f"this machine, disk + {link}"

    def recall(role: str) -> str:
        return f"{rec[n[role]]['recall']:.1%}"

    def share(role: str, of: str, key: str = "parameters") -> str:
        return f"{rec[n[role]]['parameters'] / rec[n[of]][key]:.1%}"

    def both(src: list[dict[str, Any]], field: str, place: str, cache: str) -> str:
        """Each predictor's ratio to no prefetch in one setting (the draft only where it ran; its
        rows from an `--only-draft` run say so)."""
        roles = [r for r in ("shipped", "plain", "fate", "promoe", "draft") if r in n]
        out = []
        for r in roles:
            row = find(src, **{field: place, "cache": cache, "predictor": n[r]})
            if r == "draft" and row is None:
                continue
            label = ratio(src, **{field: place, "cache": cache, "predictor": n[r]})
            out.append(f"{short(n[r])} {label}" + (" (run 2)" if row and row.get("run") else ""))
        return ", ".join(out)

    sweep = d["sweep"]["phone (UFS 3.1)"]
    fast = f"SpecPrefetch {sweep[n['shipped']][-1]:.2f}× at {sweep['mb_per_s'][-1]:.0f} MB/s"
    mbs = sweep["mb_per_s"]
    sd = mbs.index(80.0) if 80.0 in mbs else None
    at_sd = (
        "; SIMULATED phone at SD-card bandwidth (80 MB/s): "
        + ", ".join(f"{short(n[r])} {sweep[n[r]][sd]:.2f}×" for r in n if n[r] in sweep)
        if sd is not None
        else ""
    )
    cold1 = "cold, 1-token prompt"
    return [
        "| the paper's claim (DeepSeek-VL2-Tiny, Qwen3-VL-30B-A3B; Snapdragon 8 Elite) | paper | here (embedded pair; MEASURED in the engine / SIMULATED) | section |",
        "|---|---|---|---|",
        f"| best mean next-layer recall against FATE, the draft model and ProMoE (9 of 10 settings) | 89.13 % vs ProMoE 75.07 %, draft 78.54 % (VL2-Tiny, HumanEval) | "
        f"SpecPrefetch {recall('shipped')} (paper's plain form {recall('plain')}), FATE {recall('fate')}, ProMoE-style {recall('promoe')}, draft {recall('draft')} | 1 |",
        f"| parameter efficiency | 1.63 M: 6.2 % of the draft's, 5.0 % of ProMoE's | {rec[n['shipped']]['parameters']:,}: {share('shipped', 'draft', 'parameters_with_draft')} "
        f"of the draft predictor's (draft model + heads), {share('shipped', 'promoe')} of ProMoE-style's | 1 |",
        f"| fast storage (NVMe): little gain, I/O already hidden | limited | MEASURED local disk, warm: {both(sp, 'link', 'disk', 'warm')}; SIMULATED phone profile at NVMe speed: {fast} | 2, 4 |",
        f"| slow storage (UFS, SD card): +15-20 % decode throughput | 1.15-1.20× | MEASURED behind `{link}`, warm: {both(sp, 'link', link, 'warm')}; "
        f"SIMULATED, this machine + `{link}`: {both(sim, 'profile', slow, 'warm')}{at_sd} | 2, 3, 4 |",
        f"| cold cache | 1.14× | MEASURED behind `{link}`, cold (empty before a 32-token prompt's prefill): {both(sp, 'link', link, 'cold')}; "
        f"cold with a 1-token prompt: {both(sp, 'link', link, cold1)}; local disk, 1-token prompt: {both(sp, 'link', 'disk', cold1)}; "
        f"SIMULATED phone, cold with a 1-token prompt: {both(sim, 'profile', 'phone (UFS 3.1)', cold1)} | 2, 3 |",
    ]


def recall_section(d: dict[str, Any]) -> list[str]:
    A = len(d["rows"][0]["recall_per_layer"])
    k, model = d["top_k"], d["model_parameters"]
    out = [
        "## 1. Next-layer recall (held out)",
        "",
        f"recall@{k}: the share of layer l+1's {k} routed experts among the {k} a predictor names, predicted from layer l "
        f"(the draft: from its own hidden state of the same token). Fitted on {d['fit_tokens']:,} tokens of "
        f"`{d['args']['train_data']}`, scored on {d['held_tokens']:,} held-out tokens of `{d['args']['data']}`; "
        f"{d['args']['steps']} steps of 1024 examples for every trained predictor (the shipped adapter's recipe).",
        "",
        "| predictor | "
        + " | ".join(f"layer {a + 1}" for a in range(A))
        + " | mean | parameters | share of the model |",
        "|---" * (A + 4) + "|",
    ]
    for r in d["rows"]:
        extra = (
            f" (+ the draft's {d['draft_parameters']:,})"
            if r["parameters_with_draft"] != r["parameters"]
            else ""
        )
        out.append(
            f"| {r['predictor']} | "
            + " | ".join(f"{x:.1%}" for x in r["recall_per_layer"])
            + f" | **{r['recall']:.1%}** | {r['parameters']:,}{extra} | {r['parameters_with_draft'] / model:.2%} |"
        )
    return out + [""]


def measured_section(d: dict[str, Any]) -> list[str]:
    a = d["args"]
    out = [
        "## 2. Decode speed, measured in the engine",
        "",
        f"One stream, {a['prompt_tokens']}-token prompts (a different one each round), {a['tokens']} greedy tokens, cache fraction "
        f"{a['cache_fraction']}, experts on disk (`--offload disk`), the exact policy; medians of {a['rounds']} interleaved rounds "
        "after a warm-up round, ratios taken within a round. Warm: one engine per cell kept across rounds; cold: a fresh engine "
        "per run whose fast tier starts empty (`--no-warm`), before the prompt's prefill or, with a 1-token prompt, when decode "
        "starts. The draft-model predictor runs the embedded draft on every token of the target's step before the "
        "target's first MoE layer plans (engine/prefetch/draft_predictor.py), through transformers' modules on the "
        "decode's own thread, so its forward is charged to the decode; its heads then predict layer l+1 from the draft's "
        "hidden state when layer l routes, through the same scheduler as the others."
        + (" Its rows come from a second run (run 2 below)." if d.get("draft_run") else ""),
        "",
    ]
    if not d["speed"]:
        return out + ["Not run (`--no-speed`).", ""] + draft_run_section(d)
    load = d.get("load_average") or {}
    if load:
        out += [
            f"Load average of the shared 2-core machine (1 minute): {load['before']:.1f} when this run started, "
            f"{load['after']:.1f} when it ended; the spread column shows what that does to a ratio.",
            "",
        ]
    out += [
        "| storage | cache | predictor | decode tok/s | × no prefetch | middle half of the rounds' ratios | stall share | hit rate | prefetches used / issued |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["speed"]:
        out.append(
            f"| {r['link']} | {r['cache']} | {r['predictor']} | {r['tok_s']:.1f} | {r['vs_none']:.2f}× | {spread(r)} | {r['stall_share']:.0%} | "
            f"{r['hit_rate']:.0%} | {r['prefetch_used']:.0f} / {r['prefetch_issued']:.0f} |"
        )
    return out + [""] + draft_run_section(d)


def draft_run_section(d: dict[str, Any]) -> list[str]:
    """The `--only-draft` run's rows, with its machine and load: ratios to its own no prefetch."""
    run = d.get("draft_run")
    if not run:
        return []
    a, load = run["args"], run.get("load_average") or {}
    rec = ", ".join(f"{r['predictor'].split(' (')[0]} {r['recall']:.1%}" for r in run["rows"])
    cost = [r["draft_ms"] for r in run["speed"] if "draft_ms" in r]
    out = [
        "### Run 2: the draft-model predictor (`python -m bench seed-003 --only-draft`)",
        "",
        f"A second run, merged into the JSON as `draft_run`: the draft-model predictor beside no prefetch and FATE (FATE "
        f"is in both runs, a bridge between them); its settings: {a['rounds']} rounds, {a['prompt_tokens']}-token "
        f"prompts, {a['tokens']} tokens, cache {a['cache_fraction']}, ratios to this run's own no prefetch. The draft's heads are refitted in this run "
        f"(held-out recall: {rec}). {run['machine']} Run time {run['seconds'] / 60:.1f} min"
        + (
            f"; load average {load['before']:.1f} when it started, {load['after']:.1f} when it ended"
            if load
            else ""
        )
        + "."
        + (
            f" The draft's own forward took {min(cost):.2f}-{max(cost):.2f} ms per target forward (cell medians; "
            f"{int(a['tokens']) - 1} of a run's {a['tokens']} forwards are one-token decode steps, the first is the "
            "prompt's), on the decode's thread."
            if cost
            else ""
        ),
        "",
        "| storage | cache | predictor | decode tok/s | × no prefetch | middle half of the rounds' ratios | stall share | hit rate | prefetches used / issued | draft ms per forward |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in run["speed"]:
        ms = f"{r['draft_ms']:.2f}" if "draft_ms" in r else "–"
        out.append(
            f"| {r['link']} | {r['cache']} | {r['predictor']} | {r['tok_s']:.1f} | {r['vs_none']:.2f}× | {spread(r)} | "
            f"{r['stall_share']:.0%} | {r['hit_rate']:.0%} | {r['prefetch_used']:.0f} / {r['prefetch_issued']:.0f} | {ms} |"
        )
    return out + [""]


def simulated_section(d: dict[str, Any], stem: str) -> list[str]:
    a = d["args"]
    out = [
        "## 3. Decode speed, simulated (all predictors, the draft model included)",
        "",
        f"SIMULATED: the router-trace simulator replays the {d['held_tokens']:,} held-out tokens with each predictor's own "
        "held-out predictions as its next-layer hook (top-k per row, the union over the step, at most top-k a layer), the "
        "exact policy and the profile's costs; it does not charge the predictor's own compute. Warm: one replay of the whole "
        f"trace; cold: {a['sim_requests']} requests of {a['prompt_tokens']} + {a['tokens']} tokens (or 1 + {a['tokens']}), each "
        "from an empty fast tier, the prompt replayed untimed. Profiles: this machine's measured disk, the same behind the emulated link, the same "
        "disk with each transfer's CPU time (O_DIRECT read and conversion, `per_load_us` of the profile) moved off the compute "
        "thread, as a DMA copy would be, and a phone on UFS 3.1 (configs/hardware/phone-ufs31.yaml; the paper's device class, on the embedded model's shape).",
        "",
        "| profile | predictor | warm tok/s | warm × no prefetch | cold × no prefetch | cold, 1-token prompt | prefetch precision (warm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["simulated"]:
        if r["cache"] != "warm":
            continue
        colds = [
            ratio(d["simulated"], profile=r["profile"], cache=c, predictor=r["predictor"])
            for c in ("cold", "cold, 1-token prompt")
        ]
        prec = r["prefetch_precision"]
        out.append(
            f"| {r['profile']} | {r['predictor']} | {r['tok_s']:.1f} | {r['vs_none']:.2f}× | "
            f"{' | '.join(colds)} | {'–' if prec != prec else f'{prec:.0%}'} |"
        )
    out += [
        "",
        "## 4. Where prefetching pays: link bandwidth (simulated)",
        "",
        f"SIMULATED warm-cache speed-up over no prefetch on the first {a['sweep_tokens']} held-out tokens, the link's "
        "bandwidth swept with each profile's compute and per-load latency held.",
        "",
        f"![simulated speed-up against link bandwidth]({stem}-bandwidth.png)",
        "",
    ]
    return out


def summary(d: dict[str, Any]) -> list[str]:
    """The page's opening: result, command, machine, limit."""
    from engine import costs_for

    n, rec = names(d), by_name(d["rows"])
    sweep = d["sweep"]["phone (UFS 3.1)"]
    sd = sweep["mb_per_s"].index(80.0) if 80.0 in sweep["mb_per_s"] else -1
    warm = [
        r["vs_none"]
        for r in speed_rows(d)
        if r["link"] == d["args"]["link"] and r["cache"] == "warm" and r["predictor"] != NONE
    ]
    measured = (
        f"MEASURED on this CPU behind `{d['args']['link']}`, warm: {min(warm):.2f}-{max(warm):.2f}× (medians; see the spread)"
        if warm
        else "not measured in the engine (`--no-speed`)"
    )
    per_load = costs_for("this-machine-disk", "embedded").per_load_s
    return [
        f"- **Result:** next-layer recall@{d['top_k']}: SpecPrefetch {rec[n['shipped']]['recall']:.1%} (the paper's plain form "
        f"{rec[n['plain']]['recall']:.1%}), ProMoE-style {rec[n['promoe']]['recall']:.1%}, FATE {rec[n['fate']]['recall']:.1%}, "
        f"draft model {rec[n['draft']]['recall']:.1%}. Decode speed over no prefetch: SIMULATED on a phone at SD-card bandwidth "
        f"SpecPrefetch {sweep[n['shipped']][sd]:.2f}×, ProMoE-style {sweep[n['promoe']][sd]:.2f}×; {measured}.",
        "- **Command:** `python -m bench seed-003` (this page, its JSON and plot; `--render-only` rewrites the page from the JSON"
        + (
            "; `--only-draft` reran the draft-model predictor's measured rows, run 2 of section 2"
            if d.get("draft_run")
            else ""
        )
        + ").",
        f"- **Machine:** {d['machine'].removeprefix('Machine: ')} The project's shared 2-core machine.",
        f"- **Limit:** no linear predictor of layer l+1's routing from x_l passes 63.4 % on this model "
        f"([prefetch_bound.md](../benchmarks/prefetch_bound.md)); on this CPU a transfer takes {per_load * 1e3:.2f} ms of the "
        "decode's own cores, so a prefetch pays only where copies leave the compute thread.",
        "",
    ]


def render(d: dict[str, Any], out: Path) -> str:
    head = [
        "# Seed 003: SpecPrefetch (learned transfer-only prefetch), run here",
        "",
        *summary(d),
        f"Generated by `python -m bench seed-003` (bench/seed_003.py); numbers in "
        f"[{out.with_suffix('.json').name}]({out.with_suffix('.json').name}). {d['machine']} The project's shared 2-core "
        "machine, with other work running: recalls are deterministic; measured speeds are ratios taken side by side in one "
        "interleaved run; SIMULATED rows come from the router-trace simulator, not from a clock.",
        "",
        f"Target `{d['model']}` ({d['model_parameters']:,} parameters, 4 MoE layers x 128 experts, top-{d['top_k']}); draft "
        f"`{d['draft']}` ({d['draft_parameters']:,} parameters, dense). Run time {d['seconds'] / 60:.1f} min, sized to fit a "
        "short session on two shared cores; larger samples: `--train-tokens`, `--test-tokens`, `--rounds`, `--sim-requests`.",
        "",
        "## The paper's claims beside this project's measurements",
        "",
    ]
    stem = out.stem
    body = (
        head
        + claims(d)
        + claim_row(d, "003", 5)
        + [""]
        + recall_section(d)
        + measured_section(d)
        + simulated_section(d, stem)
        + section(d, "003", 5, "seed-003")
    )
    old = out.read_text() if out.exists() else ""
    kept = old[old.index(KEEP_FROM) :] if KEEP_FROM in old else ""
    return "\n".join(body) + ("\n" + kept.lstrip("\n") if kept else "")


def write_plot(d: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = d["sweep"]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5 * len(sweeps), 3.8), sharey=True)
    for ax, (profile, s) in zip(list(axes), sweeps.items()):
        for name, ys in s.items():
            if name != "mb_per_s":
                ax.plot(s["mb_per_s"], ys, marker="o", label=short(name))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{profile}\n(SIMULATED, warm)", fontsize=9)
        ax.set_xlabel("link bandwidth, MB/s")
    axes[0].set_ylabel("decode speed-up over no prefetch")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_name(out.stem + "-bandwidth.png"), dpi=120)
    plt.close(fig)
