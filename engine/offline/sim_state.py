"""The simulator's state: the trace as Python lists, the fast tier (the engine's residency core on
a simulated clock), the link, the CPU workers, the policies and the clock. The replay's steps are
in sim_prefetch.py, sim_layer.py and simulator.py, each a subclass of the one before."""

from __future__ import annotations

import functools
import random

import numpy as np

from engine.experts.tiers.residency import Residency
from engine.offline.hardware import Costs
from engine.offline.sim_settings import SimResult, SimSettings
from policies.adaptive_k import AdaptiveK
from policies.registry import PolicyBundle
from policies.utility import SpeculativeUtilityEstimator, UtilityEviction, protect_ticks


class SimLink:
    """The engine's link: bandwidth is one serial pipe; each of the `workers` transfer threads
    waits out its own transfer's latency, so latencies overlap (engine/experts/tiers/link.py).
    Queued prefetches start only when a worker is idle (demand loads jump the queue, as the
    transfer engine's priority queue does; a started transfer is never preempted)."""

    def __init__(self, costs: Costs, workers: int) -> None:
        self.bw_s = costs.expert_bytes / (costs.link_mb_per_s * 1e6)
        self.latency_s = costs.link_latency_s
        self.pipe_free_at = 0.0
        self.worker_free_at = [0.0] * workers
        self.queue: dict[
            int, None
        ] = {}  # prefetch keys in submission order (one priority); a dict: O(1) removal

    def start(self, now: float) -> float:
        """Start a transfer no earlier than `now` on the first free worker; return when it lands."""
        wf = self.worker_free_at
        w = wf.index(min(wf))
        start = max(now, wf[w], self.pipe_free_at)
        self.pipe_free_at = start + self.bw_s
        wf[w] = self.pipe_free_at + self.latency_s
        return wf[w]

    def next_start(self) -> float:
        return max(min(self.worker_free_at), self.pipe_free_at)

    def pending(self, now: float) -> int:
        """Transfers queued or still running at `now` (TransferEngine.pending)."""
        return len(self.queue) + sum(1 for w in self.worker_free_at if w > now)


class ReplayState:
    def __init__(
        self, trace: dict, policies: PolicyBundle, costs: Costs, settings: SimSettings | None = None
    ) -> None:
        settings = settings if settings is not None else SimSettings()
        self.s, self.costs, self.pol = settings, costs, policies
        ids, weights = trace["ids"], trace["weights"]  # [N, L, k]
        self.logits = trace.get("logits")  # [N, L, E] or None
        bias = trace["meta"].get("score_bias")
        if self.logits is not None and bias is not None:
            # Stand-ins ranked as the router ranks, sigmoid + balancing bias, as the engine does (OffloadedMoeBlock).
            self.logits = (
                1.0 / (1.0 + np.exp(-self.logits.astype(np.float32)))
                + np.asarray(bias, dtype=np.float32)[None]
            )
        if policies.miss.needs_logits and self.logits is None:
            raise ValueError(
                "this policy ranks stand-ins by router logit: record the trace with --logits, or use --substitute drop"
            )
        self.N, self.L, self.k = ids.shape
        self.E = int(trace["meta"]["num_experts"])
        # Python lists once: the replay loop is per (row, layer) and numpy scalars are slow there.
        self.ids = ids.astype(np.int64).tolist()
        self.weights = weights.astype(np.float64).tolist()
        # The engine's residency rules (engine/experts/tiers/residency.py) on the simulated clock: ready[key] is
        # when the expert landed (or will land; INF while its prefetch is queued). No pin on reserve:
        # the replay pins the current layer's experts itself (pin_only).
        self.cache = Residency(
            max(1, round(settings.cache_fraction * self.L * self.E)),
            policies.eviction,
            protect_ticks(self.L),
        )
        wants_utility = (
            settings.prefetch == "utility"
            or isinstance(policies.eviction, UtilityEviction)
            or settings.cpu_experts != "off"
        )
        self.utility = SpeculativeUtilityEstimator(self.E) if wants_utility else None
        if isinstance(policies.eviction, UtilityEviction) and policies.eviction.estimator is None:
            policies.eviction.estimator = self.utility  # as the loader binds it
        policies.eviction.bind(range(self.L), self.E)  # trace layers are MoE layer positions
        self.link = SimLink(costs, costs.transfer_workers)
        self.cpu_free_at = [0.0] * costs.cpu_workers
        self.rng = random.Random(settings.seed)
        self.k_policy = AdaptiveK(settings.k, adaptive=settings.adaptive)
        self.r = SimResult()
        self.clock = 0.0
        self.bg_cpu_s = (
            0.0  # compute-thread time owed to background transfers (prefetch, admission)
        )
        self.predicted: set[int] = set()  # the predictor's prefetches still queued (not started)
        self._dense_s: dict[
            tuple[int, int], float
        ] = {}  # costs.d by (rows, requests): the replay asks it every layer
        self._g_of = functools.lru_cache(maxsize=None)(costs.g)  # costs.g by rows, likewise
