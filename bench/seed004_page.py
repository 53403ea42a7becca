"""Rendering docs/seeds/004-spac.md from bench/seed_004.py's results: the paper's claims beside
this project's measurements, one table per experiment, and two plots (the crossover grid, the
cache-ratio sweep). The hand-written analysis from the line `## Why the results differ` on is kept
on a rerun."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.seed004_claims import (
    claims,
    long_command,
    opening,
    sampled_command,
    section_args,
    text_name,
)
from bench.seed_real_shape_page import claim_row, section

KEEP_FROM = "\n## Why the results differ"
# the utility estimator's ablation (bench/seed004_runs.py CONFIGS)
ABLATION = "spec+cpu, no utility"
# did a section-6 cell generate plain's tokens (–: unseeded sampling, not expected to)
SAME = {True: "yes", False: "no", None: "–"}


def pct(v: float) -> str:
    return "–" if v != v else f"{v:.0%}"


def llama_tpv(r: dict[str, Any]) -> str:
    """A llama-server row's tokens a verification (produced / (produced - accepted)) and its draft's
    acceptance (accepted / drafted), or – without a draft."""
    if "draft_acceptance" not in r:
        return "–"
    return f"{r['tokens_per_verification']:.2f} ({r['draft_acceptance']:.0%} of drafted accepted)"


def by(rows: list[dict[str, Any]], *keys: str) -> dict[tuple, dict[str, Any]]:
    return {tuple(r[k] for k in keys): r for r in rows}


def main_section(d: dict[str, Any]) -> list[str]:
    m, s = d["measured"], d["simulated"]
    if not m.get("main"):
        return ["## 1. Every configuration, measured", "", "Not run (`--no-measure`).", ""]
    a = d.get("measured_args", d["args"])
    sim = by(s["here"], "config")
    sim_hi = by(s.get("here_high", []), "config")
    out = [
        "## 1. Every configuration, measured (simulated beside it)",
        "",
        f"One greedy stream, {a['prompt_tokens']}-token prompts from `{a['data']}`, {a['tokens']} tokens each, prefill excluded; "
        f"medians of {a['rounds']} interleaved rounds after a warm-up round (round r uses prompt r in every cell). "
        "× plain: against the same setting's `plain` (no speculation, fetch-all, LRU) in the same round. "
        "SIMULATED × plain: the router-trace simulator on this machine's measured profile (`this-machine-disk-hdd`), same labels, "
        "with the spec benchmark's acceptance (about 1.9 tokens a verification) and, in the next column, with 0.87 a position "
        "(about 3.9, as these runs had).",
        "",
        "| setting | configuration | decode tok/s | × plain | × llama-server -md | SIMULATED × plain | at 0.87 a position | tokens / verification | stall share | hit rate | prefetch precision | prefetch recall | expert MB / token | CPU-run experts / token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in m["main"]:
        eng = "hit_rate" in r
        simx = sim.get((r["config"],))
        simc = f"{simx['vs_plain']:.2f}×" if simx and "cache 1" not in r["where"] else "–"
        hi = sim_hi.get((r["config"],))
        simc += " | " + (f"{hi['vs_plain']:.2f}×" if hi and "cache 1" not in r["where"] else "–")
        peer = f"{r['ratio_extra']:.2f}×" if "ratio_extra" in r else "–"
        tail = (
            f"{r['tokens_per_verification']:.2f} | {r['stall_share']:.0%} | {r['hit_rate']:.0%} | {pct(r['precision'])} | "
            f"{pct(r['recall'])} | {r['bytes_per_token'] / 1e6:.2f} | {r['cpu_calls_per_token']:.1f} |"
            if eng
            else f"{llama_tpv(r)} | – | – | – | – | – | – |"
        )
        ratio = f"{r['ratio']:.2f}×" if eng else "–"
        out.append(
            f"| {r['where']} | {r['config']} | {r['tok_s']:.1f} | {ratio} | {peer} | {simc} | {tail}"
        )
    if not any(r["config"] == ABLATION for r in m["main"]):
        out += [
            "",
            f"`{ABLATION}` (the utility estimator's ablation) joined the configurations after this run; "
            "it is measured in section 6, beside plain and spec+utility+cpu in the same rounds.",
        ]
    return out + [""]


def sampled_section(d: dict[str, Any]) -> list[str]:
    """Section 6: the exact configurations on greedy and on sampled text (seeded and unseeded),
    per prompt text."""
    from bench.seed004_runs import SEED

    rows = d["measured"].get("sampled", [])
    if not rows:
        return []
    run = d.get("sampled_run")
    a = section_args(d, "sampled")
    how = (
        f"Measured apart (`{sampled_command(d)}`, {run['seconds'] / 60:.1f} min; {run['machine'].removeprefix('Machine: ')} "
        "Other work ran beside it: figures are ratios within one interleaved round) and merged into the JSON."
        if run
        else "Measured in the page's run."
    )
    same = all(r["same_tokens_as_plain"] is not False for r in rows)
    out = [
        "## 6. Sampled text: the same comparison where the text does not repeat",
        "",
        f"At cache {a['cache']} behind `{a['link']}`, one stream, {a['prompt_tokens']}-token prompts from each text, "
        f"{a['tokens']} tokens each, prefill excluded, medians of {a['rounds']} interleaved rounds after a warm-up round "
        "(round r uses the text's prompt r in every cell). Each configuration runs greedy and sampled at "
        f"T = {float(a['temperature']):g}, seeded and unseeded. Seeded, round r's request is seeded {SEED} + r: the "
        "engine draws a seeded token from the seed and its position alone, so an exact configuration, with or without "
        "speculation, generates the same text, and a proposal is accepted only where it is the token drawn; the draft "
        "proposes by the same race of the seed's draws (engine/worker/sampling.py `seeded_draw`), so the two agree "
        "about as often as the rejection rule accepts. Unseeded, a proposal is accepted by the rejection rule "
        "(min(1, p(d) / q(d))), and each cell samples its own text. "
        + (
            "Checked: in every round every greedy and seeded configuration generated plain's tokens."
            if same
            else "Checked: some configurations did not generate plain's tokens (the last column)."
        )
        + f" {ABLATION}: k = 4 speculation and CPU-run experts with LRU eviction and no utility prefetch "
        "(the `spec` row's eviction). × plain: against `plain` (fetch-all, LRU) of the same text and decoding in the same round. "
        + how,
        "",
        "| text | decoding | configuration | decode tok/s | × plain | tokens / verification | stall share | hit rate | "
        "CPU-run experts / token | plain's tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {text_name(r['text'])} | {r['decoding']} | {r['config']} | {r['tok_s']:.1f} | {r['ratio']:.2f}× | "
        f"{r['tokens_per_verification']:.2f} | {r['stall_share']:.0%} | {r['hit_rate']:.0%} | "
        f"{r['cpu_calls_per_token']:.1f} | {SAME[r['same_tokens_as_plain']]} |"
        for r in rows
    ]
    return out + [""]


def projected_section(d: dict[str, Any]) -> list[str]:
    a, s = d["args"], d["simulated"]
    out = [
        f"## 2. PROJECTED onto the paper's hardware ({a['profile']}, {a['shape']})",
        "",
        f"The router trace of the embedded model projected onto {a['shape']}'s shape (engine/offline/projection.py) and replayed "
        f"on the `{a['profile']}` profile's costs at cache {a['cache']}, {a['proj_tokens']} tokens; SIMULATED and PROJECTED, "
        "no measurement behind them. Acceptance: the embedded draft's measured per-position rates.",
        "",
        "| configuration | PROJECTED tok/s | × plain | tokens / verification | loads / token | prefetches / token | stall share | CPU-run experts / token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['config']} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}× | {r['tokens_per_verification']:.2f} | {r['loads_per_token']:.2f} | "
        f"{r.get('prefetches_per_token', float('nan')):.2f} | {r['stall_share']:.0%} | {r['cpu_calls_per_token']:.1f} |"
        for r in s["projected"]
    ]
    return out + [""]


def sweep_section(d: dict[str, Any], stem: str) -> list[str]:
    a, m, s = d.get("measured_args", d["args"]), d["measured"], d["simulated"]
    out = [
        "## 3. Cache ratio 0.1-0.75",
        "",
        f"![tok/s against the cache ratio]({stem}-cache.png)",
        "",
    ]
    if m.get("sweep"):
        out += [
            f"MEASURED behind `{a['link']}`, {a['sweep_tokens']} tokens a request, {a['rounds']} interleaved rounds:",
            "",
            "| cache | configuration | decode tok/s | × plain | tokens / verification | hit rate | stall share | CPU-run experts / token |",
            "|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {r['cache']:g} | {r['config']} | {r['tok_s']:.1f} | {r['ratio']:.2f}× | {r['tokens_per_verification']:.2f} | "
            f"{r['hit_rate']:.0%} | {r['stall_share']:.0%} | {r['cpu_calls_per_token']:.1f} |"
            for r in m["sweep"]
        ]
        out.append("")
    out += [
        f"PROJECTED ({a['profile']}, {a['shape']}):",
        "",
        "| cache | configuration | PROJECTED tok/s | × plain | loads / token | CPU-run experts / token |",
        "|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['cache']:g} | {r['config']} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}× | {r['loads_per_token']:.2f} | {r['cpu_calls_per_token']:.1f} |"
        for r in s["projected_sweep"]
    ]
    return out + [""]


def long_pair_words(a: dict[str, Any]) -> str:
    """Which pair the long generations ran on: the long-context pair, or (older runs) the embedded
    pair itself, whose 1024-token context bounded the lengths."""
    model = a.get("long_model")
    if not model:
        return "on the embedded pair, whose context is 1024 tokens (prompt + length must fit)."
    return (
        f"on `{model}` and its draft: the embedded pair fine-tuned on 4096-token windows (context 4096; "
        "its card: models/embedded/long/README.md), so prompt + length must fit 4096."
    )


def long_section(d: dict[str, Any]) -> list[str]:
    m, s = d["measured"], d["simulated"]
    run = d.get("long_run")
    a = section_args(d, "long")
    out = ["## 4. Long generations", ""]
    if m.get("long"):
        out += [
            f"MEASURED at cache {a['cache']} behind `{a['link']}` (llama-server -md: in RAM), one request per length, "
            f"{a['long_rounds']} interleaved round(s) after a warm-up round, {a['prompt_tokens']}-token prompts; "
            f"{long_pair_words(a)} × shortest: against the same configuration at the shortest length, same round."
            + (
                f" Measured apart (`{long_command(d)}`, "
                f"{run['seconds'] / 60:.1f} min; {run['machine'].removeprefix('Machine: ')}) and merged into the JSON."
                if run
                else ""
            ),
            "",
            "| tokens | configuration | decode tok/s | × shortest | tokens / verification | stall share | hit rate |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in m["long"]:
            eng = "hit_rate" in r
            tail = (
                f"{r['tokens_per_verification']:.2f} | {r['stall_share']:.0%} | {r['hit_rate']:.0%} |"
                if eng
                else f"{llama_tpv(r)} | – | – |"
            )
            out.append(
                f"| {r['tokens']} | {r['config']} | {r['tok_s']:.1f} | {r['ratio']:.2f}× | {tail}"
            )
        out.append("")
    out += [
        "SIMULATED on this machine's profile: one request of each length replayed from the trace (the trace is one "
        f"{s['trace_tokens']}-token stream, so lengths beyond the pair's context are replayable):",
        "",
        "| tokens | configuration | SIMULATED tok/s | × plain | tokens / verification | loads / token |",
        "|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['tokens']} | {r['config']} | {r['tok_s']:.1f} | {r['vs_plain']:.2f}× | {r['tokens_per_verification']:.2f} | {r['loads_per_token']:.2f} |"
        for r in s["long"]
    ]
    return out + [""]


def crossover_section(d: dict[str, Any], stem: str) -> list[str]:
    s = d["simulated"]
    hc = s["here_costs"]
    out = [
        "## 5. Where speculation as a sensor would pay (SIMULATED crossover)",
        "",
        f"![best exact speculative over best exact plain]({stem}-crossover.png)",
        "",
        "Each cell: the best exact speculative configuration (spec, spec+utility, spec+utility+cpu; k = 4) over the best "
        "exact one without speculation (plain, plain reuse, plain+cpu), both replayed on this machine's profile with two "
        "costs changed: the time of one expert load (x) and the compute of each extra row of a step as a share of the "
        f"first row's (y; 0 is a GPU's batched GEMM at decode sizes, 1 a CPU doing every row again). This machine: "
        f"{hc['load_ms']:.2f} ms a load behind hdd, the draft {hc['draft_ms']:.2f} ms a proposed token. "
        "Ratio > 1: speculation pays.",
        "",
        "| panel | extra row / first row | " + " | ".join(f"{x:g} ms" for x in _loads(s)) + " |",
        "|---|---|" + "---|" * len(_loads(s)),
    ]
    grid = by(s["crossover"], "panel", "row_share", "load_ms")
    for panel in _panels(s):
        for rs in sorted({r["row_share"] for r in s["crossover"]}):
            cells = [grid[(panel, rs, x)] for x in _loads(s)]
            out.append(
                f"| {panel} | {rs:g} | "
                + " | ".join(
                    (f"**{c['ratio']:.2f}**" if c["ratio"] > 1 else f"{c['ratio']:.2f}")
                    for c in cells
                )
                + " |"
            )
    return out + [""]


def _panels(s: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(r["panel"] for r in s["crossover"]))


def _loads(s: dict[str, Any]) -> list[float]:
    return sorted({r["load_ms"] for r in s["crossover"]})


def render(d: dict[str, Any], out: Path) -> str:
    body = (
        opening(d, out)
        + ["## The paper's claims beside this project's measurements", ""]
        + claims(d)
        + claim_row(d, "004", 7)
        + [""]
        + main_section(d)
        + projected_section(d)
        + sweep_section(d, out.stem)
        + long_section(d)
        + crossover_section(d, out.stem)
        + sampled_section(d)
        + section(d, "004", 7, "seed-004")
    )
    old = out.read_text() if out.exists() else ""
    kept = old[old.index(KEEP_FROM) :] if KEEP_FROM in old else ""
    return "\n".join(body) + ("\n" + kept.lstrip("\n") if kept else "")


def write_plots(d: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = d["simulated"]
    drafts = _panels(s)
    loads, rows = _loads(s), sorted({r["row_share"] for r in s["crossover"]})
    grid = by(s["crossover"], "panel", "row_share", "load_ms")
    fig, axes = plt.subplots(1, len(drafts), figsize=(5.2 * len(drafts), 4.4), squeeze=False)
    for ax, ds in zip(axes[0], drafts):
        z = [[grid[(ds, rs, x)]["ratio"] for x in loads] for rs in rows]
        im = ax.pcolormesh(
            range(len(loads) + 1), range(len(rows) + 1), z, cmap="RdBu", vmin=0.4, vmax=1.6
        )
        if len(rows) > 1 and len(loads) > 1:  # the ratio-1 line needs a 2-D grid
            ax.contour(
                [i + 0.5 for i in range(len(loads))],
                [i + 0.5 for i in range(len(rows))],
                z,
                levels=[1.0],
                colors="k",
            )
        for i in range(len(rows)):
            for j in range(len(loads)):
                ax.text(j + 0.5, i + 0.5, f"{z[i][j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks([i + 0.5 for i in range(len(loads))], [f"{x:g}" for x in loads])
        ax.set_yticks([i + 0.5 for i in range(len(rows))], [f"{r:g}" for r in rows])
        ax.set_xlabel("ms per expert load")
        if ax is axes[0][0]:  # one label: the panels share the axis
            ax.set_ylabel("extra row's compute / first row's")
        ax.set_title(ds.replace(", ", ",\n") + "\nbest spec / best plain (SIMULATED)", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(out.with_name(out.stem + "-crossover.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for src, rows_, key, style in (
        ("measured", d["measured"].get("sweep", []), "ratio", "-o"),
        ("PROJECTED", s["projected_sweep"], "vs_plain", "--s"),
    ):
        for cfg in dict.fromkeys(r["config"] for r in rows_):
            pts = [(r["cache"], r[key]) for r in rows_ if r["config"] == cfg]
            ax.plot(*zip(*pts), style, label=f"{cfg} ({src})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("cache ratio (fast-tier share of the experts)")
    ax.set_ylabel("tok/s × plain at the same ratio")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_name(out.stem + "-cache.png"), dpi=130)
    plt.close(fig)
