"""Belady's MIN beside the engine's expert loads in `python -m bench serve --belady`.

With a partial fast tier, how good is the engine's cache under load? The physical limit is not "every
expert resident" (the tier cannot hold them) but the fewest loads any eviction policy could make on the
same accesses: Belady's MIN (engine/offline/belady.py). The engine writes every MoE layer call's experts to
a route log (--route-log, engine/experts/route_log.py); each pass marks where its calls start and end in
the log, and reads the engine's load counters from /metrics before and after. At the end of each pass MIN
runs over the log so far (everything up to the pass's last call, from an empty tier: its first loads fall in
the warm-up), and the pass counts the loads of that best schedule inside its own calls; later passes' accesses
do not reach back into it.

The projected rate is labelled so wherever it appears: the pass's wall time less the stall the engine's
extra loads cost, assuming each load stalls the compute thread as much as the pass's average load did
(stall seconds / engine loads). It is a bound on what a better policy could reach on these accesses, not a
measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import min_load_positions, read_route_log


@dataclass(frozen=True)
class LoadMark:
    """Where a pass starts or ends: calls in the route log, and the engine's load counters."""

    calls: int
    loads: float  # expert transfers of every kind (demand, prefetch, admission): each one a read
    stall_s: float


class BeladyProbe:
    """Marks passes of one engine and sets MIN's loads beside the engine's."""

    def __init__(self, log: Path, base_url: str) -> None:
        self.log, self.base_url = log, base_url.rstrip("/")

    def mark(self) -> LoadMark:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        loads = stall = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "moe_offload_expert_transfers_total":
                    loads += s.value
                elif s.name == "moe_offload_expert_stall_seconds_total":
                    stall = s.value
        _, _, calls = read_route_log(self.log)
        return LoadMark(len(calls), loads, stall)

    def compare(
        self, before: LoadMark, after: LoadMark, output_tokens: int, duration_s: float
    ) -> dict[str, Any]:
        """The pass's loads against MIN's on its calls, per output token, and the projected rate."""
        slots, experts, calls = read_route_log(self.log)
        keys = [[layer * experts + e for e in ids] for layer, ids in calls]
        starts = [0, *accumulate(len(k) for k in keys)]  # flat offset of each call
        sequence = [k for call in keys for k in call]
        lo, hi = starts[before.calls], starts[min(after.calls, len(calls))]
        best = sum(1 for p in min_load_positions(sequence, slots) if lo <= p < hi)
        engine = after.loads - before.loads
        stall = after.stall_s - before.stall_s
        per_load = stall / engine if engine else 0.0
        projected = duration_s - max(0.0, engine - best) * per_load
        tokens = max(output_tokens, 1)
        return {
            "slots": slots,
            "engine_loads_per_token": engine / tokens,
            "min_loads_per_token": best / tokens,
            "engine_over_min": engine / best if best else float("nan"),
            "stall_share": stall / duration_s if duration_s else float("nan"),
            "projected_min_tok_s": output_tokens / projected if projected > 0 else float("nan"),
        }


def belady_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table of the engine's loads beside MIN's, one line per pass that has them."""
    rows = [r for r in rows if "belady" in r]
    if not rows:
        return []
    lines = [
        "",
        "Expert loads beside Belady's MIN on the same accesses (the engine's route log; MIN from an "
        "empty tier over the log up to the pass's end). The last column is projected, not measured: the pass's wall "
        "time less the stall of the engine's extra loads at its own average stall per load.",
        "",
        "| workload | rate (req/s) | fast-tier slots | loads / token: engine | Belady's MIN | engine / MIN | "
        "stall share of wall | out tok/s measured | projected at MIN's loads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["workload"], r["rate"])):
        b = r["belady"]
        lines.append(
            f"| {r['workload']} | {r['rate']:g} | {b['slots']} | {b['engine_loads_per_token']:.2f} | "
            f"{b['min_loads_per_token']:.2f} | {b['engine_over_min']:.2f}× | {b['stall_share']:.0%} | "
            f"{r['output_throughput']:.1f} | {b['projected_min_tok_s']:.1f} (projected) |"
        )
    return lines
