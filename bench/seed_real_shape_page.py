"""Rendering the seed pages' real-shape section (bench/seed_real_shape.py's `real_shape` in each
seed's JSON): one table per seed, every heading and row marked RANDOM WEIGHTS, and a row for the
page's claims table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RANDOM = "RANDOM WEIGHTS"


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _x(x: float) -> str:
    return f"{x:.2f}×"


# seed -> (baseline's name in the ratio column, [(column, figure, format)])
Column = tuple[str, str, Callable[[float], str]]
COLUMNS: dict[str, tuple[str, list[Column]]] = {
    "000": (
        "fetch-all",
        [
            ("decode tok/s", "tok_s", lambda v: f"{v:.2f}"),
            ("× fetch-all", "ratio", _x),
            ("expert calls substituted", "substituted_share", _pct),
            ("expert MB read / token", "bytes_per_token", lambda v: f"{v / 1e6:.1f}"),
        ],
    ),
    "003": (
        "none",
        [
            ("decode tok/s", "tok_s", lambda v: f"{v:.2f}"),
            ("× none", "ratio", _x),
            ("recall (prefetched / needed from disk)", "recall", _pct),
            ("stall share", "stall_share", _pct),
        ],
    ),
    "004": (
        "plain",
        [
            ("decode tok/s", "tok_s", lambda v: f"{v:.2f}"),
            ("× plain", "ratio", _x),
            ("tokens / verification", "tokens_per_verification", lambda v: f"{v:.2f}"),
            ("hit rate", "hit_rate", _pct),
            ("stall share", "stall_share", _pct),
            ("CPU-run experts / token", "cpu_calls_per_token", lambda v: f"{v:.1f}"),
        ],
    ),
}

WHAT = {
    "000": "fetch-all against the 0.15 rule, the first-choice rule and the two presets (prefetch off)",
    "003": "no prefetch against the FATE-like guess (the next layer's router on this layer's input) and "
    "SpecPrefetch's adapter, both through the engine's adapter hook",
    "004": "plain decoding (LRU) against CPU-run experts, speculation, and speculation with utility "
    "prefetch, utility eviction and CPU-run experts; the n-gram (prompt-lookup) proposer, k = 4, "
    "STANDS IN FOR THE DRAFT MODEL (the checkpoint has none)",
}


# What a column counts, said under the table.
NOTES = {
    "000": "Substituted: the share of expert calls (resident, fetched or substituted) a stand-in served. MB "
    "read: expert bytes moved from disk per generated token, background admissions included.",
    "003": "Recall here is the engine's: the disk loads a layer needed that a prefetch had brought or started, "
    "over all it needed; it counts only what the window-aware scheduler chose to issue, where the held-out "
    "recall@k above scores the predictor's ranking alone.",
    "004": "Tokens / verification: accepted proposals + 1 per verification window. CPU-run experts: the "
    "balancer's choice per token (on a CPU-only machine the fast device is the CPU too, so the path shows "
    "its cost, not its benefit).",
}
READS = {
    "O_DIRECT": "which bypasses the page cache: every miss is a read from the disk",
    "pread+DONTNEED": "pread, then fadvise(DONTNEED) drops the pages it read",
}


def label(seed: str, config: str) -> str:
    """A row's first cell: the configuration, what stands in for the draft, and RANDOM WEIGHTS."""
    stand_in = ", n-gram proposer standing in for the draft" if config.startswith("spec") else ""
    return f"{config}{stand_in}, {RANDOM}"


def table(seed: str, rows: list[dict[str, Any]]) -> list[str]:
    _, cols = COLUMNS[seed]
    out = [
        "| configuration | " + " | ".join(c for c, _, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [fmt(r[key]) for _, key, fmt in cols]
        out.append(f"| {label(seed, r['config'])} | " + " | ".join(cells) + " |")
    return out


def _adapter_line(rs: dict[str, Any]) -> str:
    a = rs.get("adapter")
    if not a:
        return ""
    return (
        f" The adapter was fitted here on {a['tokens']} tokens of `{a['data']}` (the float32 forward's trace, "
        f"{a['steps']} steps): held-out recall@k {a['heldout_recall']:.1%} against the FATE-like guess's "
        f"{a['heldout_recall_fate']:.1%}."
    )


def section(d: dict[str, Any], seed: str, number: int, command: str) -> list[str]:
    """The page's section `number`: nothing when the JSON has no real-shape run."""
    rs = d.get("real_shape")
    if not rs:
        return []
    sh, ck = rs["shape"], rs["checkpoint"]
    machine = rs["machine"].removeprefix("Machine: ").removesuffix(".")
    note = f", {rs['note']}" if rs.get("note") else ""
    reads = "; ".join(f"{m} ({READS.get(m, m)})" for m in rs["disk_reads"]) or "no read"
    base = rs["rows"][0]
    return [
        "",
        f"## {number}. Real shapes ({RANDOM}): Qwen3-30B-A3B's layer shape at {sh['layers']} layers",
        "",
        f"**{RANDOM}.** A checkpoint of Qwen3-30B-A3B's released layer shape ({sh['experts']} experts a layer, "
        f"top-{sh['top_k']}, bf16) at {sh['layers']} decoder layers, random weights (bench/real_shapes.py; "
        f"{ck['bytes'] / 1e9:.1f} GB at `{ck['path']}`, not committed). Random weights route as no trained model "
        "does, and their text means nothing: quality and perplexity are not measured, only speed and bytes. "
        f"Their routing is far from uniform: at cache {rs['cache']:g} the {base['config']} cell found "
        f"{base['hit_rate']:.0%} of its expert calls in the fast tier (uniform routing: about {rs['cache']:.0%}). "
        f"Here: {WHAT[seed]}.",
        "",
        f"- **Machine:** {machine}{note}. Load average {rs['load_average']['before']:.2f} "
        f"before, {rs['load_average']['after']:.2f} after; run time {rs['seconds'] / 60:.1f} min.",
        f"- **Cells:** cache {rs['cache']:g} ({sh['n_slots']} of {sh['total_experts']} experts resident), experts "
        "read from the machine's own disk (a virtual disk: what its host caches is not seen) with no emulated "
        f"link; the disk tier opened the checkpoint with {reads}; the {base['config']} cell's reads ran at "
        f"{base['read_gb_s']:.2f} GB/s (bytes over the transfer threads' busy time). A {rs['prompt_tokens']}-token "
        f"random prompt, {rs['tokens']} greedy tokens (decode clock after the first); {rs['rounds']} interleaved "
        "rounds after a warm-up round (round r: every cell on prompt r), medians; the ratio is the median of "
        f"per-round ratios to {COLUMNS[seed][0]}." + _adapter_line(rs),
        f"- **Command:** `python -m bench {command} --only-real-shape` (bench/seed_real_shape.py).",
        "",
        *table(seed, rs["rows"]),
        "",
        NOTES[seed],
        "",
    ]


def claim_row(d: dict[str, Any], seed: str, number: int) -> list[str]:
    """A row for the page's claims table: the section's ratios in one line (none without a run)."""
    rs = d.get("real_shape")
    if not rs:
        return []
    ratios = "; ".join(f"{r['config']} {r['ratio']:.2f}×" for r in rs["rows"][1:])
    if any(r["config"].startswith("spec") for r in rs["rows"]):
        ratios += ", the n-gram proposer standing in for the draft"
    cells = [
        f"the same designs at Qwen3-30B-A3B's layer shape, {RANDOM} (4 layers, disk, cache 0.25)",
        "–",
        f"{ratios} (ratios to {COLUMNS[seed][0]}; {RANDOM}: speed only)",
        *(["–"] if seed == "004" else []),  # its claims table has a SIMULATED column
        str(number),
    ]
    return ["| " + " | ".join(cells) + " |"]
