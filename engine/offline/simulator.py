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

import functools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.offline.hardware import Costs
from policies.adaptive_k import AdaptiveK
from policies.balancer import LayerCosts, choose_tau, rank_misses
from policies.base import DROPPED, FilteredView
from policies.registry import PolicyBundle
from policies.utility import PREFETCH_MIN_LEVEL, SpeculativeUtilityEstimator, UtilityEviction, protect_ticks, worth_displacing

# Mirrors of engine constants (imported where that does not pull in torch-heavy modules).
INF = math.inf

# Measured on the embedded pair (docs/benchmarks/speculative.md, draft k=4, one stream, cache 0.25 disk):
# share of windows whose accepted run reaches position i.
MEASURED_ACCEPTANCE = (0.38, 0.33, 0.13, 0.07)


class Predictor(Protocol):
    """The hook for a learned next-layer predictor (SpecPrefetch's adapter), FATE, or an oracle.

    `predict(token, layer)` is called after MoE layer `layer` ran on trace row `token` and
    returns experts of layer `layer + 1`, most likely first. The simulator prefetches the union
    over the step's rows, in rank order, up to `predictor_budget` per layer."""

    def predict(self, token: int, layer: int) -> Sequence[int]: ...


class OraclePredictor:
    """Predicts the trace's own next-layer experts; with recall < 1 a share of them is replaced
    by random wrong experts (a test of the hook and an upper bound for any predictor)."""

    def __init__(self, trace: dict, recall: float = 1.0, seed: int = 0) -> None:
        self.ids, self.recall = trace["ids"], recall
        self.E = int(trace["meta"]["num_experts"])
        self.rng = random.Random(seed)

    def predict(self, token: int, layer: int) -> list[int]:
        true = [int(e) for e in self.ids[token, layer + 1]]
        return [e if self.rng.random() < self.recall else self.rng.randrange(self.E) for e in true]


@dataclass(frozen=True)
class Acceptance:
    """How many of k proposals a verification window keeps: P(accepted run >= i) = by_position[i-1]
    (made non-increasing), drawn independently per window from a seeded generator."""

    by_position: tuple[float, ...] = MEASURED_ACCEPTANCE

    def draw(self, k: int, rng: random.Random) -> int:
        u, kept, bound = rng.random(), 0, 1.0
        for i in range(k):
            bound = min(bound, self.by_position[i] if i < len(self.by_position) else 0.0)
            if u < bound:
                kept += 1
            else:
                break
        return kept


@dataclass(frozen=True)
class SimSettings:
    cache_fraction: float = 0.25
    streams: int = 1
    speculative: bool = False
    k: int = 4  # proposals per window (the most, with adaptive k)
    adaptive: bool = True  # k per stream from the adaptive-k policy (policies/adaptive_k.py)
    acceptance: Acceptance = field(default_factory=Acceptance)
    prefetch: str = "none"  # none | utility
    cpu_experts: str = "off"  # off | auto | all
    max_tokens: int | None = None  # stop after this many generated tokens (all streams)
    # Tokens per request: the streams' requests end together after this many tokens and new ones
    # start with a fresh adaptive-k state, as the benchmarks' cells do (None: one request per stream).
    request_tokens: int | None = None
    # Each request begins with this many trace tokens as its prompt: one prefill step of that many
    # rows, replayed (it shapes the cache, as the engine's prefill does) but left out of every
    # figure, since the benchmarks start their decode clocks after the prefill. 0: no prompt.
    prompt_tokens: int = 0
    warm: bool = True  # the engine's warm start: fill the fast tier round-robin across layers
    seed: int = 0
    predictor: Any = None  # a Predictor, or None
    predictor_budget: int | None = None  # prefetches per layer and step from the predictor (default: top-k)


@dataclass
class SimResult:
    tokens: int = 0
    steps: int = 0
    calls: int = 0
    calls_hit: int = 0
    calls_fetched: int = 0
    calls_substituted: int = 0
    substituted_mass: float = 0.0
    admissions: int = 0
    evictions: int = 0
    demand_loads: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_cancelled: int = 0
    cpu_expert_calls: int = 0
    stall_s: float = 0.0
    compute_s: float = 0.0
    draft_s: float = 0.0
    token_layers: int = 0  # rows x MoE layers replayed (the replay-speed unit)
    verifications: int = 0  # windows with at least one proposal
    verified_tokens: int = 0  # tokens those windows produced
    replay_s: float = 0.0  # wall time of the replay itself

    def minus(self, before: SimResult, after: SimResult) -> None:
        """Take out what happened between two snapshots (an untimed prefill); the replay's own
        work (token-layers, wall time) stays counted."""
        for f in fields(self):
            if f.name not in ("token_layers", "replay_s"):
                setattr(self, f.name, getattr(self, f.name) - (getattr(after, f.name) - getattr(before, f.name)))

    @property
    def seconds(self) -> float:
        return self.stall_s + self.compute_s + self.draft_s

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        calls = max(self.calls, 1)
        d.update(simulated=True, tokens_per_s=self.tokens / self.seconds if self.seconds else float("inf"),
                 hit_share=self.calls_hit / calls, fetched_per_token=self.calls_fetched / max(self.tokens, 1),
                 substituted_per_token=self.calls_substituted / max(self.tokens, 1),
                 mean_substituted_mass=self.substituted_mass / max(self.token_layers, 1),
                 stall_share=self.stall_s / self.seconds if self.seconds else 0.0,
                 loads_per_token=self.demand_loads / max(self.tokens, 1),
                 tokens_per_verification=self.verified_tokens / self.verifications if self.verifications else 1.0,
                 prefetch_precision=self.prefetch_used / (self.prefetch_used + self.prefetch_wasted) if self.prefetch_used + self.prefetch_wasted else float("nan"),
                 prefetch_recall=self.prefetch_used / (self.prefetch_used + self.demand_loads) if self.prefetch_used + self.demand_loads else float("nan"),
                 token_layers_per_s=self.token_layers / self.replay_s if self.replay_s else float("nan"))
        return d


class SimLink:
    """The engine's link: bandwidth is one serial pipe; each of the `workers` transfer threads
    waits out its own transfer's latency, so latencies overlap (engine/experts/link.py).
    Queued prefetches start only when a worker is idle (demand loads jump the queue, as the
    transfer engine's priority queue does; a started transfer is never preempted)."""

    def __init__(self, costs: Costs, workers: int) -> None:
        self.bw_s = costs.expert_bytes / (costs.link_mb_per_s * 1e6)
        self.latency_s = costs.link_latency_s
        self.pipe_free_at = 0.0
        self.worker_free_at = [0.0] * workers
        self.queue: dict[int, None] = {}  # prefetch keys in submission order (one priority); a dict: O(1) removal

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


class _Cache:
    """Residency of the fast tier, as engine/experts/expert_store.py keeps it, without tensors:
    `ready[key]` is when the expert landed (or will land; INF while its prefetch is queued)."""

    def __init__(self, n_slots: int, policies: PolicyBundle) -> None:
        self.n_slots, self.ev = n_slots, policies.eviction
        self.ready: dict[int, float] = {}  # INF while queued; a time ahead of the clock while in flight
        self.protected: dict[int, int] = {}  # key -> tick at which its protection expires
        self.pinned: set[int] = set()
        self.tick_no = 0
        self.evictions = 0
        self.wasted = 0

    def land(self, key: int, t: float) -> None:
        self.ready[key] = t

    def evictable(self, now: float, protected: bool) -> FilteredView:
        """Landed, unpinned experts, protected ones or not (store._evictable): a live view, as the
        store's, so a policy that walks its own order asks `in` of a few keys instead of this
        building a set of every resident for each load (the replay's hot spot). Live: a victim
        dropped or a key reserved after it was made is seen."""
        ready, prot = self.ready, self.protected
        return FilteredView(ready.keys(), lambda k: ready[k] <= now and k not in self.pinned and (k in prot) == protected)

    def evictable_set(self, now: float) -> set[int]:
        """The unprotected evictable experts as a set: for a step that reserves many slots while
        many residents are pinned, one set per layer beats asking the live view key by key."""
        return {k for k, t in self.ready.items() if t <= now} - self.pinned - self.protected.keys()

    def reserve(self, key: int, now: float, may_evict_protected: bool, victim: int | None = None, cand: set[int] | None = None) -> bool:
        """A slot for `key` (store.reserve): free, or the eviction policy's victim among landed,
        unpinned experts, unprotected first. False when nothing can be evicted. `victim`: the
        policy's victim, when the caller already asked for it; `cand`: an evictable_set the caller
        keeps across the reservations of one layer (the victim leaves it here)."""
        if len(self.ready) >= self.n_slots:
            if victim is None:
                victim = self.ev.victim(self.evictable(now, False) if cand is None else cand)
            if cand is not None:
                cand.discard(victim)
            if victim is None and may_evict_protected:
                victim = self.ev.victim(self.evictable(now, True))
            if victim is None:
                return False
            self.drop(victim)
            self.evictions += 1
        self.land(key, INF)
        self.ev.on_insert(key)
        return True

    def drop(self, key: int) -> None:
        del self.ready[key]
        if self.protected.pop(key, None) is not None:
            self.wasted += 1  # a prefetch evicted before use
        self.ev.on_remove(key)

    def tick(self) -> None:
        """One MoE layer ran: protections that were never used expire (wasted prefetches)."""
        self.tick_no += 1
        expired = [k for k, t in self.protected.items() if t <= self.tick_no]
        for k in expired:
            del self.protected[k]
        self.wasted += len(expired)


def load_trace(path: str | Path) -> dict:
    z = np.load(path)
    return trace_from_arrays({k: z[k] for k in z.files})


def trace_from_arrays(arrays: dict) -> dict:
    """A trace as the simulator reads it, from the arrays record_trace returns or a saved .npz holds
    (its meta, stored as a JSON string, parsed)."""
    return {**arrays, "meta": json.loads(str(arrays["meta"]))}


class Simulator:
    def __init__(self, trace: dict, policies: PolicyBundle, costs: Costs, settings: SimSettings = SimSettings()) -> None:
        self.s, self.costs, self.pol = settings, costs, policies
        ids, weights = trace["ids"], trace["weights"]  # [N, L, k]
        self.logits = trace.get("logits")  # [N, L, E] or None
        bias = trace["meta"].get("score_bias")
        if self.logits is not None and bias is not None:
            # Stand-ins ranked as the router ranks, sigmoid + balancing bias, as the engine does (OffloadedMoeBlock).
            self.logits = 1.0 / (1.0 + np.exp(-self.logits.astype(np.float32))) + np.asarray(bias, dtype=np.float32)[None]
        if policies.miss.needs_logits and self.logits is None:
            raise ValueError("this policy ranks stand-ins by router logit: record the trace with --logits, or use --substitute drop")
        self.N, self.L, self.k = ids.shape
        self.E = int(trace["meta"]["num_experts"])
        # Python lists once: the replay loop is per (row, layer) and numpy scalars are slow there.
        self.ids = ids.astype(np.int64).tolist()
        self.weights = weights.astype(np.float64).tolist()
        self.cache = _Cache(max(1, round(settings.cache_fraction * self.L * self.E)), policies)
        wants_utility = settings.prefetch == "utility" or isinstance(policies.eviction, UtilityEviction) or settings.cpu_experts != "off"
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
        self.bg_cpu_s = 0.0  # compute-thread time owed to background transfers (prefetch, admission)
        self.predicted: set[int] = set()  # the predictor's prefetches still queued (not started)
        self._dense_s: dict[tuple[int, int], float] = {}  # costs.d by (rows, requests): the replay asks it every layer
        self._g_of = functools.lru_cache(maxsize=None)(costs.g)  # costs.g by rows, likewise

    # -- the link and the queue of prefetches ---------------------------------------------
    def _advance(self, now: float) -> None:
        """Start queued prefetches that a worker would have picked up by `now`."""
        q, link = self.link.queue, self.link
        while q and link.next_start() <= now:
            key = next(iter(q))
            del q[key]
            self.predicted.discard(key)
            self.cache.land(key, link.start(link.next_start()))
            self.bg_cpu_s += self.costs.per_load_s

    def _prefetch(self, key: int) -> None:
        self.link.queue[key] = None
        self.cache.protected[key] = self.cache.tick_no + protect_ticks(self.L)
        self.r.prefetch_issued += 1

    def _top_up(self, layer: int) -> bool:
        """engine/experts/utility_prefetch.py UtilityPrefetcher.top_up, over the simulated store:
        the hottest missing experts, into a free slot or over a victim worth displacing."""
        est, cache, E = self.utility, self.cache, self.E
        assert est is not None
        for e in est.ranked(layer, PREFETCH_MIN_LEVEL):
            if self.link.pending(self.clock) >= len(self.link.worker_free_at):
                return False  # no idle transfer worker (UtilityPrefetcher.max_pending)
            key = layer * E + e
            if key in cache.ready:  # resident, or already on its way
                continue
            victim = None
            if len(cache.ready) >= cache.n_slots:
                victim = cache.ev.victim(cache.evictable(self.clock, False))
                if victim is None:
                    return False
                if not worth_displacing(est, cache.ev, key, int(victim)):
                    continue
            if not cache.reserve(key, self.clock, False, victim=victim):
                return False
            self._prefetch(key)
        return True

    def _cancel_stale(self) -> None:
        est, cache = self.utility, self.cache
        assert est is not None
        keep: dict[int, None] = {}
        for key in self.link.queue:
            if est.level(*divmod(key, self.E)) < PREFETCH_MIN_LEVEL:
                cache.protected.pop(key, None)
                del cache.ready[key]
                cache.ev.on_remove(key)
                self.r.prefetch_cancelled += 1
            else:
                keep[key] = None
        self.link.queue = keep

    def _predict(self, rows: list[int], layer: int) -> None:
        """The predictor hook: prefetch the union of its ranked predictions for `layer + 1`."""
        pred, cache, E = self.s.predictor, self.cache, self.E
        budget = self.s.predictor_budget or self.k
        ranked: dict[int, None] = {}
        lists = [pred.predict(t, layer) for t in rows]
        for i in range(max(map(len, lists), default=0)):  # interleave ranks across rows: rank 0 of every row first
            for lst in lists:
                if i < len(lst):
                    ranked.setdefault(int(lst[i]))
        chosen = list(ranked)[:budget]
        nxt = (layer + 1) * E
        # Never evict what the same prediction asks for (a resident predicted expert is about to be
        # used): pinned while its slots are reserved, as the engine's lease pins them.
        cache.pinned = {nxt + e for e in chosen}
        for e in chosen:
            key = nxt + e
            if key in cache.ready:
                continue
            if not cache.reserve(key, self.clock, False):
                break
            self._prefetch(key)
            self.predicted.add(key)
        cache.pinned = set()

    # -- one MoE layer of one step ----------------------------------------------------------
    def _layer(self, li: int, rows: list[int], requests: int) -> None:
        c, cache, r, pol = self.costs, self.cache, self.r, self.pol
        E, base = self.E, li * self.E
        T = len(rows)
        ready_at = cache.ready
        ev = cache.ev
        # Attention, norms and router run before the experts; transfers started in the background
        # since the last layer cost the compute thread their CPU share (per_load_s: 0 off a CPU-only box).
        dense = self._dense_s.get((T, requests))
        if dense is None:
            dense = self._dense_s[(T, requests)] = c.d(T, requests)
        now = self.clock + dense + self.bg_cpu_s
        self.bg_cpu_s = 0.0
        if self.link.queue:
            self._advance(now)
        ev.on_layer(li)
        get = ready_at.get
        is_res = lambda e: get(base + e, INF) <= now  # noqa: E731  landed = resident, as store.is_resident
        ids, weights = self.ids, self.weights
        exp = [ids[t][li] for t in rows]
        logits = [self.logits[t, li].tolist() for t in rows] if pol.miss.needs_logits else None
        plan = pol.miss.plan(li, exp, [weights[t][li] for t in rows], is_res, logits)
        if T == 1:
            rows_of = dict.fromkeys(plan.experts[0], 1)
            rows_of.pop(DROPPED, None)
        else:
            rows_of = Counter(e for row in plan.experts for e in row if e != DROPPED)
        if plan.fetch:
            fetch = set(plan.fetch)
            ready = sorted(e for e in rows_of if e not in fetch)  # touched in id order, as the executor does
        else:
            ready = sorted(rows_of)
        cache.pinned = {base + e for e in rows_of}
        protected = cache.protected
        for e in ready:
            ev.on_access(base + e)
        if protected:
            for e in ready:
                if protected.pop(base + e, None) is not None:
                    r.prefetch_used += 1
        on_cpu: list[int] = []
        if plan.fetch and self.s.cpu_experts != "off":
            on_cpu = self._cpu_split(li, plan.fetch, ready, rows_of, now)
        g = self._g_of
        busy = sum([g(rows_of[e]) for e in ready])
        link = self.link
        new_loads: list[int] = []  # demand transfers to start now, with the CPU experts' reads
        joined: list[tuple[float, int]] = []
        cand: set[int] | None = None
        for e in plan.fetch:
            if on_cpu and e in on_cpu:
                continue
            key = base + e
            t = get(key)
            if t is not None:  # a prefetch (or admission) in flight or queued: join it, as transfers.submit does
                if t == INF:
                    del link.queue[key]
                    self.predicted.discard(key)
                    new_loads.append(e)
                else:
                    joined.append((t, e))
                if protected.pop(key, None) is not None:
                    r.prefetch_used += 1
            else:
                if cand is None and T > 1 and len(ready_at) >= cache.n_slots:
                    cand = cache.evictable_set(now)
                cache.reserve(key, now, True, cand=cand)  # if all slots are pinned it still runs (a spill)
                new_loads.append(e)
                r.demand_loads += 1
        landing, cpu_end = self._schedule(base, new_loads, on_cpu, rows_of, now)
        if joined:
            landing += joined
        end, stall = now + busy, 0.0
        if len(landing) > 1:
            landing.sort()
        for t, e in landing:  # each loaded expert runs as it lands (the executor's order)
            if t > end:
                stall += t - end
                end = t
            # A CPU-run expert on a box whose CPU is the fast device: its read overlapped, its
            # compute holds the compute thread (same cores); a copied expert runs on the device.
            run = (c.h(rows_of[~e]) if e < 0 else g(rows_of[e])) + c.per_load_s  # every read from the slow tier costs per_load_s
            end += run
            busy += run
        if on_cpu:  # the compute thread collects the CPU results last
            if cpu_end > end:
                stall += cpu_end - end
                end = cpu_end
            r.cpu_expert_calls += len(on_cpu)
        r.compute_s += now - self.clock + busy
        r.stall_s += stall
        self.clock = end
        r.calls += T * self.k
        r.calls_hit += plan.calls_hit
        r.calls_fetched += plan.calls_fetched
        if plan.substituted:
            r.calls_substituted += len(plan.substituted)
            r.substituted_mass += sum(m for _, m in plan.substituted)
        r.token_layers += T
        cache.pinned = set()
        for e in pol.admission.observe(li, plan.substituted):
            # Background: the link and a worker, never the compute clock (after compute, as _admit).
            key = base + e
            if key not in ready_at and cache.reserve(key, end, may_evict_protected=False):
                cache.land(key, link.start(end))
                self.bg_cpu_s += c.per_load_s
                r.admissions += 1
        if self.predicted:
            # The predictor's prefetches for this layer that never started missed their window:
            # cancelled (a queued transfer is cancellable, transfers.cancel), counted as cancelled.
            for key in [k for k in self.predicted if base <= k < base + E]:
                self.predicted.discard(key)
                if key in link.queue:
                    del link.queue[key]
                    cache.protected.pop(key, None)
                    del cache.ready[key]
                    cache.ev.on_remove(key)
                    r.prefetch_cancelled += 1
        if cache.protected:
            cache.tick()
        else:
            cache.tick_no += 1
        if self.utility is not None and self.s.prefetch == "utility" and self.utility.windows:
            self._top_up((li + 1) % self.L)
        if self.s.predictor is not None and li + 1 < self.L:
            self._predict(rows, li)

    def _cpu_split(self, li: int, fetch: Sequence[int], ready: list[int], rows_of: dict[int, int], now: float) -> list[int]:
        """moe_executor._cpu_split: in-flight prefetches stay on the fast device, the rest hottest
        first (utility level, then rows); τ from policies.balancer.choose_tau with the profile's costs."""
        c, base = self.costs, li * self.E
        level = (lambda e: self.utility.level(li, e)) if self.utility is not None else (lambda e: 0)  # noqa: E731
        in_flight = [e for e in fetch if base + e in self.cache.ready] if self.s.cpu_experts != "all" else []
        ranked = rank_misses(fetch, in_flight, level, rows_of)
        if self.s.cpu_experts == "all":
            tau = len(in_flight)
        else:
            cpu_h = c.cpu if not c.cpu_reads_over_link else (c.cpu[0] + c.copy_seconds(), c.cpu[1])
            costs = LayerCosts(sum(c.g(rows_of[e]) for e in ready), c.copy_seconds(), c.fast, cpu_h, c.transfer_workers, c.cpu_workers)
            capacity = self.cache.n_slots - len(self.cache.pinned)  # store.free_or_evictable
            tau = choose_tau([rows_of[e] for e in ranked], costs, capacity, len(in_flight))
        return ranked[tau:]

    def _schedule(self, base: int, loads: list[int], cpu: list[int], rows_of: dict[int, int], now: float) -> tuple[list[tuple[float, int]], float]:
        """Start this layer's demand transfers (transfer workers) and CPU-run experts (CPU workers)
        in time order: whichever pool has a worker free first takes its next job, so both share
        the serial pipe as the engine's threads do. A CPU worker reads its expert (over the link
        on a disk box) and computes it. Returns (landing time, expert) of the loads and the time
        the last CPU expert finishes. Where the CPU is the fast device, a CPU-run expert's compute
        is left to the compute thread: it is returned among the landings as (read done, ~expert)."""
        link, c, free, cache = self.link, self.costs, self.cpu_free_at, self.cache
        landing: list[tuple[float, int]] = []

        def load(e: int) -> None:  # a demand transfer on the first free transfer worker
            t = link.start(now)
            if base + e in cache.ready:
                cache.land(base + e, t)
            landing.append((t, e))

        if not cpu:  # transfers only (the common case): no pool to interleave with
            for e in loads:
                load(e)
            return landing, now
        end, i, j = now, 0, 0
        while i < len(loads) or j < len(cpu):
            tf = max(now, min(link.worker_free_at)) if i < len(loads) else INF
            tc = max(now, min(free)) if j < len(cpu) else INF
            if tf <= tc:
                load(loads[i])
                i += 1
                continue
            e = cpu[j]
            j += 1
            w = free.index(min(free))
            start = max(now, free[w])
            if c.cpu_reads_over_link:
                # The read books the same serial pipe; its latency is waited out on the CPU worker.
                start = max(start, link.pipe_free_at)
                link.pipe_free_at = start + link.bw_s
                start = link.pipe_free_at + link.latency_s
            if c.cpu_is_fast_device:
                free[w] = start  # the worker is free once read; the compute joins the compute thread's queue
                landing.append((start, ~e))  # ~e: a CPU-run expert (see _layer)
                continue
            free[w] = start + c.h(rows_of[e])
            end = max(end, free[w])
        return landing, end

    # -- steps ------------------------------------------------------------------------------
    def _warm(self) -> None:
        cache, E, L = self.cache, self.E, self.L
        per_layer = -(-cache.n_slots // L)
        for e in range(min(per_layer, E)):
            for layer in range(L):
                if len(cache.ready) < cache.n_slots:
                    cache.reserve(layer * E + e, 0.0, False)
                    cache.ready[layer * E + e] = 0.0

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
            live = [i for i in range(S) if pos[i] < ends[i] and (not s.request_tokens or cell[i] < s.request_tokens)]
            if not live:
                if not s.request_tokens or all(pos[i] >= ends[i] for i in range(S)):
                    break
                # Every request of the cell is done: the next cell's requests start, with a fresh
                # proposer and adaptive-k state, as bench/spec_bench.py builds them per cell.
                cell, cells, prefilled = [0] * S, cells + 1, False
                self.k_policy = AdaptiveK(s.k, adaptive=s.adaptive)
                continue
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
            if deepest:
                draft = deepest * self.costs.draft_token_s  # one batched draft forward per proposed position
                self.clock += draft
                r.draft_s += draft
            step_t0 = self.clock
            all_rows = [t for _, rows, _ in windows for t in rows]
            for li in range(L):
                self._layer(li, all_rows, len(windows))
            r.steps += 1
            if s.speculative and deepest:
                # As engine/speculative/proposals.py: one proposed token against the target's (verification) step.
                self.k_policy.observe_costs(self.costs.draft_token_s / max(self.clock - step_t0, 1e-12), None)
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

    def _snapshot(self) -> SimResult:
        return replace(self.r, evictions=self.cache.evictions, prefetch_wasted=self.cache.wasted)

    def _prefill(self, streams: list[int], pos: list[int], ends: list[int]) -> tuple[SimResult, SimResult]:
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
        counts: dict[int, tuple[list[int], list[int]]] = {}
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


def simulate(trace: dict, policies: PolicyBundle, cache_fraction: float, costs: Costs, warm: bool = True, **settings: Any) -> SimResult:
    """Replay `trace` under `policies` on `costs` (see SimSettings for the other settings)."""
    return Simulator(trace, policies, costs, SimSettings(cache_fraction=cache_fraction, warm=warm, **settings)).run()


def manual_costs(link_mb_per_s: float, latency_us: float, expert_bytes: int, layer_compute_s: float,
                 expert_compute_s: float, workers: int = 2) -> Costs:
    """Costs from a few flat numbers (no profile): dense and per-expert time independent of rows."""
    return Costs(profile=f"manual ({link_mb_per_s:g} MB/s + {latency_us:g} us)", shape="trace", expert_bytes=expert_bytes,
                 link_mb_per_s=link_mb_per_s, link_latency_s=latency_us * 1e-6, transfer_workers=workers,
                 fast=(expert_compute_s, 0.0), cpu=(expert_compute_s, 0.0), cpu_workers=2,
                 dense=(layer_compute_s, 0.0), notes=("manual",))
