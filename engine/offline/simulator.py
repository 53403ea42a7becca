"""Router-trace simulator: replay recorded routing under a policy and a hardware profile.

It drives the very same policy objects as the engine (they are pure: the miss policy, the
eviction and admission policies, the speculative utility estimator, the adaptive-k rule and
the CPU/GPU balancer's `choose_tau`), against a discrete-time model of the fast tier (slots,
pins of the current layer, protected prefetches) and of the machine (a serial link with
per-transfer latency overlapped across the transfer workers, the compute thread, CPU
workers), with costs from a hardware profile (engine/offline/hardware.py). It estimates
tokens/s, stall, hits, loads and prefetch precision without running the model. Every figure
it produces is *simulated*; on a projected shape (engine/offline/projection.py) also *projected*.

What one step does, as the engine does it (engine/core/engine_core.py, engine/experts/):
1. each stream contributes one row (plain decode) or a verification window of k+1 rows
   (speculative decoding; k from the adaptive-k policy, the draft's cost charged per proposed
   token); the acceptance model draws how many proposals are kept (see `Acceptance`);
2. per MoE layer: the dense part (d(rows)); the miss policy plans over all rows of the step;
   resident experts run first, demand loads start on the link (joining a prefetch in flight),
   and, with CPU-run experts, the balancer's cut τ over the ranked misses sends the rest to CPU
   workers; the layer ends when the last landed expert and the last CPU expert are done;
   background admissions follow; the utility prefetcher tops up the next layer, and an
   optional `Predictor` (the learned adapter's hook) prefetches its predictions for the next layer;
3. after the step the utility estimator observes the window counts (all rows, kept rows), stale
   queued prefetches are cancelled and every layer is topped up.

Limitations, by construction:
- the trace holds the exact model's routing: under a substituting policy the real hidden
  states drift and later layers' routing would differ slightly; rejected draft rows are
  replayed with the routing of the true next tokens (the draft's guesses are not in the trace);
- the engine's balancer learns its costs online and explores; here it is given the profile's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.offline.hardware import Costs
from engine.offline.sim_layer import LayerReplay
from engine.offline.sim_settings import (
    MEASURED_ACCEPTANCE,
    Acceptance,
    OraclePredictor,
    Predictor,
    SimResult,
    SimSettings,
    load_trace,
    manual_costs,
    trace_from_arrays,
)
from engine.offline.sim_state import SimLink
from policies.adaptive_k import AdaptiveK
from policies.registry import PolicyBundle

__all__ = [
    "MEASURED_ACCEPTANCE",
    "Acceptance",
    "OraclePredictor",
    "Predictor",
    "SimLink",
    "SimResult",
    "SimSettings",
    "Simulator",
    "load_trace",
    "manual_costs",
    "simulate",
    "trace_from_arrays",
]


class Simulator(LayerReplay):
    # -- steps ------------------------------------------------------------------------------
    def _warm(self) -> None:
        cache, E, L = self.cache, self.E, self.L
        per_layer = -(-cache.n_slots // L)
        for e in range(min(per_layer, E)):
            for layer in range(L):
                if cache.free:
                    cache.reserve(layer * E + e, False, 0.0, pin=False)
                    cache.land(layer * E + e, 0.0)

    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        s, r, N, L = self.s, self.r, self.N, self.L
        if s.warm:
            self._warm()
        S = max(1, s.streams)
        budget = (s.max_tokens or N) // S  # tokens per stream
        starts = [i * N // S for i in range(S)]
        pos = list(starts)
        ends = [min(N, starts[i] + budget, starts[i + 1] if i + 1 < S else N) for i in range(S)]
        cell = [0] * S  # tokens of each stream's current request
        cells = 0
        untimed: list[tuple[SimResult, SimResult]] = []  # (before, after) of every prefill
        prefilled = False
        while True:
            if s.prompt_tokens and not prefilled:
                prefilled = True
                waiting = [i for i in range(S) if pos[i] < ends[i]]
                if waiting:
                    untimed.append(self._prefill(waiting, pos, ends))
            live = [
                i
                for i in range(S)
                if pos[i] < ends[i] and (not s.request_tokens or cell[i] < s.request_tokens)
            ]
            if not live:
                if not s.request_tokens or all(pos[i] >= ends[i] for i in range(S)):
                    break
                # Every request of the cell is done: the next cell's requests start, with a fresh
                # proposer and adaptive-k state, as bench/spec_bench.py builds them per cell.
                cell, cells, prefilled = [0] * S, cells + 1, False
                self.k_policy = AdaptiveK(s.k, adaptive=s.adaptive)
                continue
            windows, deepest = self._windows(live, pos, ends, cell, cells)
            if deepest:
                draft = (
                    deepest * self.costs.draft_token_s
                )  # one batched draft forward per proposed position
                self.clock += draft
                r.draft_s += draft
            step_t0 = self.clock
            all_rows = [t for _, rows, _ in windows for t in rows]
            for li in range(L):
                self._layer(li, all_rows, len(windows))
            r.steps += 1
            if s.speculative and deepest:
                # As engine/speculative/proposals.py: one proposed token against the target's (verification) step.
                self.k_policy.observe_costs(
                    self.costs.draft_token_s / max(self.clock - step_t0, 1e-12), None
                )
            if self.utility is not None:
                self._observe(windows)
                # The estimator's update and the top-ups run on the compute thread between steps.
                self.clock += self.costs.utility_step_s
                r.compute_s += self.costs.utility_step_s
        r.evictions, r.prefetch_wasted = self.cache.evictions, self.cache.wasted
        for before, after in untimed:
            r.minus(before, after)
        r.replay_s = time.perf_counter() - t_wall
        return r

    def _windows(
        self, live: list[int], pos: list[int], ends: list[int], cell: list[int], cells: int
    ) -> tuple[list[tuple[int, list[int], int]], int]:
        """This step's rows of each `live` stream: one (plain decode) or a verification window of
        k+1 (speculative), of which the acceptance model keeps some. Advances `pos` and `cell` (the
        tokens of each stream's current request, in cell `cells`) by the kept rows. Returns the
        windows, (stream, rows, kept rows), and the deepest k."""
        s, r = self.s, self.r
        windows: list[tuple[int, list[int], int]] = []  # (stream, rows, kept rows)
        deepest = 0
        for i in live:
            left = ends[i] - pos[i] - 1
            if s.request_tokens:
                left = min(left, s.request_tokens - cell[i] - 1)
            k = min(self.k_policy.k_for(f"{cells}.{i}") if s.speculative else 0, left)
            # A rejected proposal's row routes like the true token at its position: the trace has
            # no routing for tokens the target did not produce. Routing such rows like random
            # tokens instead made speculation behind disk 0.35-0.65x of off against 0.82-1.0x
            # measured (docs/benchmarks/simulator.md): real proposals share most experts with
            # the true tokens, so this errs on the optimistic side.
            rows = list(range(pos[i], pos[i] + k + 1))
            kept = s.acceptance.draw(k, self.rng) if k else 0
            if k:
                self.k_policy.observe(f"{cells}.{i}", k, kept)
                r.verifications += 1
                r.verified_tokens += kept + 1
            deepest = max(deepest, k)
            windows.append((i, rows, kept + 1))
            pos[i] += kept + 1
            cell[i] += kept + 1
            r.tokens += kept + 1
        return windows, deepest

    def _snapshot(self) -> SimResult:
        return replace(self.r, evictions=self.cache.evictions, prefetch_wasted=self.cache.wasted)

    def _prefill(
        self, streams: list[int], pos: list[int], ends: list[int]
    ) -> tuple[SimResult, SimResult]:
        """One prefill step: the next `prompt_tokens` trace tokens of each stream in one batch
        (as the engine prefills a request). Returns the result before and after it."""
        before = self._snapshot()
        rows: list[int] = []
        for i in streams:
            n = min(self.s.prompt_tokens, ends[i] - pos[i])
            rows += range(pos[i], pos[i] + n)
            pos[i] += n
        for li in range(self.L):
            self._layer(li, rows, len(streams))
        return before, self._snapshot()

    def _observe(self, windows: list[tuple[int, list[int], int]]) -> None:
        """The sensor's report (all rows, kept rows per layer) into the estimator, then the
        utility prefetcher's after-step work (UtilityPrefetcher.on_windows)."""
        E, est = self.E, self.utility
        assert est is not None
        counts: dict[int, tuple[Sequence[int], Sequence[int]]] = {}
        for li in range(self.L):
            tot, acc = [0] * E, [0] * E
            for _, rows, kept in windows:
                for j, t in enumerate(rows):
                    for e in self.ids[t][li]:
                        tot[e] += 1
                        if j < kept:
                            acc[e] += 1
            counts[li] = (tot, acc)
        est.observe(counts)
        if self.s.prefetch == "utility":
            self._cancel_stale()
            for li in range(self.L):
                if not self._top_up(li):
                    break


def simulate(
    trace: dict,
    policies: PolicyBundle,
    cache_fraction: float,
    costs: Costs,
    warm: bool = True,
    **settings: Any,
) -> SimResult:
    """Replay `trace` under `policies` on `costs` (see SimSettings for the other settings)."""
    return Simulator(
        trace, policies, costs, SimSettings(cache_fraction=cache_fraction, warm=warm, **settings)
    ).run()
