"""MoE-SpAc's Heterogeneous Workload Balancer: which missed experts are copied to the fast
device and which are computed by the CPU straight from host memory.

Decision. For one MoE layer of one step, the missed experts are ranked hottest first (utility
level, then rows routed to them in this step: hot experts are worth a fast-tier copy, and
many rows amortise it). The balancer picks the cut τ in that ranking: the first τ experts are
copied and run on the fast device, the rest run on the CPU. This is the seed's threshold on
utility, refined so that one level can be split. τ = number of missed experts copied.

Cost model (all times in seconds, measured online by engine/experts/cost_meter.py):
- fast device: F(τ) = max(G_res + Σ_{i<τ} g(n_i),  ceil(τ / W) · c + g(n_{τ-1}))
  the device computes the resident experts (G_res) and each copied one, while W transfer
  workers copy at c seconds per expert; the last copy's compute cannot start before it lands;
- CPU: C(τ) = max(Σ_{i≥τ} h(n_i) / P,  max_{i≥τ} h(n_i)), P CPU workers in parallel;
  h includes reading the expert from the host tier;
- g(n) = g0 + g1·n and h(n) = h0 + h1·n: per-expert cost as a function of its row count.
τ minimises the layer's makespan max(F(τ), C(τ)), subject to τ ≥ τ_min (experts that cannot
run on the CPU) and τ ≤ capacity (fast-tier slots that can be taken now). The optimum over τ is
exact: every τ is evaluated with prefix sums (a sort-and-sweep, O(M) after the sort).

The seed's ablation replaces the optimized τ with a fixed threshold on utility: `fixed_tau` copies
every missed expert whose level is at least a constant (EngineConfig.balancer_level), whatever
the costs (bench/seed_004.py measures one against the other).

Pure: numbers in, a number out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCosts:
    resident_seconds: float  # G_res: fast-device time of the experts already resident
    copy_seconds: float  # c: one expert from the slow tier into a fast-tier slot
    fast: tuple[float, float]  # (g0, g1): fast-device seconds per expert = g0 + g1 * rows
    cpu: tuple[float, float]  # (h0, h1): CPU seconds per expert (read + compute) = h0 + h1 * rows
    transfer_workers: int = 1  # W
    cpu_workers: int = 1  # P

    def g(self, rows: int) -> float:
        return self.fast[0] + self.fast[1] * rows

    def h(self, rows: int) -> float:
        return self.cpu[0] + self.cpu[1] * rows


def rank_misses(
    missed: Sequence[int],
    in_flight: Sequence[int],
    level: Callable[[int], int],
    rows: Mapping[int, int],
) -> list[int]:
    """The balancer's ranking of a layer's missed experts: those already on their way first (they
    stay on the fast device), then hottest first (utility level, then rows in this step, then id)."""
    on_way = set(in_flight)
    moving = [e for e in missed if e in on_way]
    return moving + sorted(
        (e for e in missed if e not in on_way), key=lambda e: (-level(e), -rows[e], e)
    )


def makespan(tau: int, rows: Sequence[int], costs: LayerCosts) -> float:
    """max(F(τ), C(τ)) for the ranked missed experts with `rows` rows each (direct formula)."""
    fast, cpu = rows[:tau], rows[tau:]
    f = costs.resident_seconds + sum(costs.g(n) for n in fast)
    if fast:
        f = max(
            f,
            math.ceil(len(fast) / costs.transfer_workers) * costs.copy_seconds + costs.g(fast[-1]),
        )
    c = max(
        sum(costs.h(n) for n in cpu) / costs.cpu_workers,
        max((costs.h(n) for n in cpu), default=0.0),
    )
    return max(f, c)


def choose_tau(rows: Sequence[int], costs: LayerCosts, capacity: int, tau_min: int = 0) -> int:
    """The makespan-optimal cut τ in [tau_min, min(len(rows), capacity)] (ties: the larger τ,
    which keeps more experts on the fast device). With no room at all, τ = tau_min."""
    M = len(rows)
    hi = max(tau_min, min(M, capacity))
    # Suffix sums and maxima of CPU cost, so each τ's C(τ) is O(1).
    h = [costs.h(n) for n in rows]
    suf_sum, suf_max = [0.0] * (M + 1), [0.0] * (M + 1)
    for i in range(M - 1, -1, -1):
        suf_sum[i] = suf_sum[i + 1] + h[i]
        suf_max[i] = max(suf_max[i + 1], h[i])
    best_tau, best = hi, math.inf
    g_sum = 0.0
    for tau in range(0, hi + 1):
        if tau:
            g_sum += costs.g(rows[tau - 1])
        if tau < tau_min:
            continue
        f = costs.resident_seconds + g_sum
        if tau:
            f = max(
                f,
                math.ceil(tau / costs.transfer_workers) * costs.copy_seconds
                + costs.g(rows[tau - 1]),
            )
        span = max(f, suf_sum[tau] / costs.cpu_workers, suf_max[tau])
        if span <= best:
            best_tau, best = tau, span
    return best_tau


def fixed_tau(levels: Sequence[int], threshold: int, capacity: int, tau_min: int = 0) -> int:
    """The fixed-threshold cut (the seed's ablation of the balancer): with the missed experts
    ranked as `rank_misses` does (`levels` their utility levels, the first `tau_min` forced onto the
    fast device), τ = tau_min + the number of the others whose level is >= `threshold`, at most
    the room left (capacity), never below tau_min. The costs play no part."""
    hot = sum(1 for lv in levels[tau_min:] if lv >= threshold)
    return max(tau_min, min(tau_min + hot, capacity))
