"""MoE-SpAc's CPU split: which of a layer's missed experts run on CPU workers instead of being
loaded into the fast tier, by the workload balancer's cut (policies/balancer.py).

`split_misses` is the decision itself, on ids and numbers only: the engine (`CpuSplit`, from its
online cost meter) and the router-trace simulator (engine/offline/, from a hardware profile)
both call it, so the simulator replays the engine's rule rather than a copy. Tensor-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from policies.balancer import LayerCosts, choose_tau, fixed_tau, rank_misses
from policies.base import DROPPED, ExpertPlan

if TYPE_CHECKING:  # annotations only: this module imports no torch
    from engine.experts.cost_meter import CostMeter
    from engine.experts.tiers.expert_store import ExpertStore
    from engine.experts.tiers.transfers import TransferEngine
    from engine.stats import EngineStats
    from policies.utility import SpeculativeUtilityEstimator

PROBE_EVERY = 256  # balancer calls between forced CPU runs that keep the CPU cost measurement fresh


def split_misses(
    misses: Sequence[int],
    in_flight: Callable[[int], bool],
    level: Callable[[int], int],
    rows: Mapping[int, int],
    mode: str,
    cut: Callable[[list[int], int], int],
) -> tuple[list[int], int]:
    """The ranked misses and the cut τ: ranked[τ:] run on the CPU.

    Ranking: experts already on their way (a prefetch in flight) stay on the fast device, the rest
    hottest first (utility level, then rows in this step). mode "all" sends every other miss to the
    CPU (a diagnostic); otherwise `cut(ranked, τ_min)` chooses τ >= τ_min, the in-flight count."""
    forced = [e for e in misses if in_flight(e)] if mode != "all" else []
    ranked = rank_misses(misses, forced, level, rows)
    return ranked, len(forced) if mode == "all" else cut(ranked, len(forced))


class CpuSplit:
    """The engine's side: the balancer's costs from the online meter, with periodic exploration."""

    def __init__(self, store: ExpertStore, transfers: TransferEngine, stats: EngineStats) -> None:
        self.store, self.transfers, self.stats = store, transfers, stats
        self.calls = 0  # balancer calls so far (every PROBE_EVERY-th explores)
        # EngineConfig.balancer_level: None, the makespan-optimal τ; N, the fixed threshold (an ablation).
        self.fixed_level: int | None = None

    def split(
        self,
        layer: int,
        plan: ExpertPlan,
        ready: list[int],
        to_load: list[int],
        mode: str,
        meter: CostMeter | None,
        utility: SpeculativeUtilityEstimator | None,
        cpu_workers: int,
    ) -> list[int]:
        """The missed experts `to_load` of `plan` that run on the CPU."""
        rows = Counter(e for row in plan.experts for e in row if e != DROPPED)
        level = (lambda e: utility.level(layer, e)) if utility is not None else (lambda e: 0)

        def cut(ranked: list[int], tau_min: int) -> int:
            if self.fixed_level is not None:
                levels = [level(e) for e in ranked]
                return fixed_tau(levels, self.fixed_level, self.store.free_or_evictable(), tau_min)
            return self._choose_tau(ready, ranked, rows, tau_min, meter, cpu_workers)

        ranked, tau = split_misses(
            to_load, lambda e: self.transfers.in_flight(layer, e), level, rows, mode, cut
        )
        self.stats.record_balancer(tau, len(ranked))
        return ranked[tau:]

    def _choose_tau(
        self,
        ready: list[int],
        ranked: list[int],
        rows: Counter,
        tau_min: int,
        meter: CostMeter | None,
        cpu_workers: int,
    ) -> int:
        assert meter is not None
        M = len(ranked)
        self.calls += 1
        with meter.lock:
            fast, cpu, copy = (
                meter.fast.coefficients(),
                meter.cpu.coefficients(),
                meter.copy_seconds,
            )
        if cpu is None or self.calls % PROBE_EVERY == 0:
            return max(tau_min, M - 1)  # explore: measure (again) what one expert costs on the CPU
        if fast is None or copy is None:
            return M  # nothing copied or computed yet: the fast path's cost is unknown, keep it
        g0, g1 = fast
        costs = LayerCosts(
            sum(g0 + g1 * rows[e] for e in ready),
            copy,
            fast,
            cpu,
            self.transfers.workers,
            cpu_workers,
        )
        return choose_tau([rows[e] for e in ranked], costs, self.store.free_or_evictable(), tau_min)
