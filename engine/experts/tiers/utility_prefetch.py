"""MoE-SpAc's asynchronous prefetch: the utility estimator's hottest non-resident experts are
queued as prefetches, and prefetches that lost their utility are cancelled.

When it acts:
- after every step, on the speculative sensor's window report: update the estimator, cancel
  stale queued prefetches, then top up every MoE layer in the order the next step visits them;
- after each MoE layer runs, for the next MoE layer: that layer's slots were just unpinned,
  so there may be room now that there was none at the start of the step.

A prefetch never displaces an expert that is at least as useful or needed sooner: it is issued
only into a free slot or over an eviction victim with a strictly lower utility level and a later
predicted next use (policies/utility.py worth_displacing). A prefetch is submitted only
while a transfer worker is idle: a started transfer is never preempted, so a guess queued on a
busy link delays the next demand load by a whole transfer (8 ms behind the hdd link), and where
the link is the bottleneck that costs more than a right guess saves (8 streams behind hdd: 1.45x
plain LRU with a deep prefetch queue, 1.66x with this rule; docs/benchmarks/spac.md). Transfers go through the
transfer engine at prefetch priority (behind every demand load), are protected once they land
until used or expired, and are counted as issued, used and wasted (engine/experts/tiers/expert_store.py).
"""

from __future__ import annotations

from engine.experts.routing_bus import RoutingBus, WindowReport
from engine.experts.tiers.expert_store import ExpertStore
from engine.experts.tiers.transfers import TransferEngine
from engine.stats import EngineStats
from policies.utility import PREFETCH_MIN_LEVEL, SpeculativeUtilityEstimator, worth_displacing


class UtilityPrefetcher:
    def __init__(
        self,
        estimator: SpeculativeUtilityEstimator,
        store: ExpertStore,
        transfers: TransferEngine,
        moe_layers: list[int],
        stats: EngineStats,
        prefetch: bool = True,
        min_level: int = PREFETCH_MIN_LEVEL,
    ) -> None:
        self.estimator, self.store, self.transfers, self.stats = estimator, store, transfers, stats
        self.moe_layers, self.prefetch, self.min_level = moe_layers, prefetch, min_level
        # Prefetches are submitted only while fewer than this many transfers are pending (see the
        # module docstring): one per transfer worker, so a guess never waits in the queue.
        self.max_pending = transfers.workers
        self._next = {la: moe_layers[(i + 1) % len(moe_layers)] for i, la in enumerate(moe_layers)}
        self.E = estimator.num_experts

    def attach(self, bus: RoutingBus) -> None:
        bus.subscribe_windows(self.on_windows)

    # -- after each step --------------------------------------------------------------------
    def on_windows(self, report: WindowReport) -> None:
        counts: dict[int, tuple[list[int], list[int]]] = {}
        for w in report.windows:
            tot, acc = counts.get(w.layer, ([0] * self.E, [0] * self.E))
            counts[w.layer] = (
                [a + b for a, b in zip(tot, w.counts.tolist())],
                [a + b for a, b in zip(acc, w.accepted_counts.tolist())],
            )
        self.estimator.observe(counts)
        self.stats.set_utility_levels(self.estimator.histogram(self.moe_layers))
        if self.prefetch:
            self.cancel_stale()
            for layer in self.moe_layers:
                if not self.top_up(layer):
                    break

    def cancel_stale(self) -> None:
        """Queued prefetches whose expert fell below the prefetch level are cancelled."""
        self.transfers.cancel_queued(
            "prefetch", lambda layer, e: self.estimator.level(layer, e) < self.min_level
        )

    # -- between layers -----------------------------------------------------------------------
    def after_layer(self, layer: int) -> None:
        if self.prefetch and self.estimator.windows:
            self.top_up(self._next[layer])

    def top_up(self, layer: int) -> bool:
        """Queue this layer's hottest missing experts while there is room. Returns False when the
        fast tier has no room for a prefetch or no transfer worker is idle (so later layers need
        not be tried now)."""
        for e in self.estimator.ranked(layer, self.min_level):
            if self.transfers.pending() >= self.max_pending:
                return (
                    False  # no idle transfer worker: a guess now would delay the next demand load
                )
            key = layer * self.E + e
            with self.store.lock:  # the victim check and the reservation see the same residency
                if self.store.state(key) is not None or self.transfers.in_flight(layer, e):
                    continue
                if not self.store.has_free_slot():
                    victim = self.store.next_victim()
                    if victim is None:
                        return False
                    if not worth_displacing(self.estimator, self.store.eviction, key, victim):
                        continue  # a colder candidate may still be needed sooner than the victim
                if self.transfers.submit(layer, e, "prefetch", protect=True) is None:
                    return False
        return True
