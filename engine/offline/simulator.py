"""Router-trace simulator: replay recorded routing under a policy and a hardware profile.

It drives the very same policy objects as the engine (they are pure), against a model of
the fast tier (a slot count, the eviction policy, pins for the current layer) and of the
link (serial, bandwidth + latency), and estimates time per token and cache behaviour
without running the model. Every figure it produces is *simulated*.

Limitation, by construction: the trace holds the routing of the exact model. Under a
substituting policy the real hidden states drift, so later layers' routing would differ
slightly; the simulator replays the exact routing regardless.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.experts.link import LinkSpec
from policies.registry import PolicyBundle


@dataclass(frozen=True)
class HardwareProfile:
    link: LinkSpec
    expert_nbytes: int
    layer_compute_s: float  # dense part of one layer for one token (attention, norms, router)
    expert_compute_s: float  # one routed expert for one token
    workers: int = 2  # concurrent transfers, as the engine's transfer_workers


class LinkModel:
    """The engine's link: bandwidth is one serial pipe, latency overlaps across the
    `workers` transfers that can be in flight at once (each worker waits for its own)."""

    def __init__(self, hw: HardwareProfile) -> None:
        self.bw_s = hw.expert_nbytes / (hw.link.mb_per_s * 1e6)
        self.latency_s = hw.link.latency_us * 1e-6
        self.pipe_free_at = 0.0
        self.worker_free_at = [0.0] * hw.workers

    def transfer(self, now: float) -> float:
        """Start a transfer no earlier than `now`; return when it lands."""
        w = min(range(len(self.worker_free_at)), key=self.worker_free_at.__getitem__)
        start = max(now, self.worker_free_at[w], self.pipe_free_at)
        self.pipe_free_at = start + self.bw_s
        self.worker_free_at[w] = self.pipe_free_at + self.latency_s
        return self.worker_free_at[w]


@dataclass
class SimResult:
    tokens: int
    calls: int
    calls_hit: int
    calls_fetched: int
    calls_substituted: int
    substituted_mass: float
    admissions: int
    evictions: int
    stall_s: float
    compute_s: float
    token_layers: int = 0

    @property
    def seconds_per_token(self) -> float:
        return (self.stall_s + self.compute_s) / self.tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(simulated=True, tokens_per_s=1.0 / self.seconds_per_token, hit_share=self.calls_hit / self.calls,
                 fetched_per_token=self.calls_fetched / self.tokens, substituted_per_token=self.calls_substituted / self.tokens,
                 mean_substituted_mass=self.substituted_mass / max(self.token_layers, 1),
                 stall_share=self.stall_s / (self.stall_s + self.compute_s))
        return d


class SimCache:
    """Residency model of the fast tier: same rules as engine.experts.expert_store, without tensors."""

    def __init__(self, n_slots: int, policies: PolicyBundle) -> None:
        self.n_slots, self.ev = n_slots, policies.eviction
        self.resident: set[int] = set()
        self.evictions = 0

    def admit(self, key: int, pinned: set[int]) -> bool:
        if key in self.resident:
            return False
        if len(self.resident) >= self.n_slots:
            victim = self.ev.victim([k for k in self.resident if k not in pinned])
            if victim is None:
                return False
            self.resident.discard(victim)
            self.ev.on_remove(victim)
            self.evictions += 1
        self.resident.add(key)
        self.ev.on_insert(key)
        return True


def load_trace(path: str | Path) -> dict:
    z = np.load(path)
    out = {k: z[k] for k in z.files}
    out["meta"] = json.loads(str(z["meta"]))
    return out


def simulate(trace: dict, policies: PolicyBundle, cache_fraction: float, hw: HardwareProfile, warm: bool = True) -> SimResult:
    ids, weights = trace["ids"], trace["weights"]  # [N, L, k]
    logits = trace.get("logits")  # [N, L, E] or None
    if policies.miss.needs_logits and logits is None:
        raise ValueError("this policy ranks stand-ins by router logit: record the trace with --logits, or use --substitute drop")
    N, L, k = ids.shape
    E = int(trace["meta"]["num_experts"])
    cache = SimCache(max(1, round(cache_fraction * L * E)), policies)
    if warm:  # the engine's warm start: round-robin across layers
        per_layer = -(-cache.n_slots // L)
        for e in range(min(per_layer, E)):
            for layer in range(L):
                if len(cache.resident) < cache.n_slots:
                    cache.admit(layer * E + e, set())
    r = SimResult(N, 0, 0, 0, 0, 0.0, 0, 0, 0.0, 0.0, token_layers=N * L)
    link = LinkModel(hw)
    clock = 0.0  # the compute thread's simulated time
    for t in range(N):
        for layer in range(L):
            row = [int(e) for e in ids[t, layer]]
            plan = policies.miss.plan(layer, [row], [[float(w) for w in weights[t, layer]]],
                                      lambda e: layer * E + e in cache.resident,
                                      [logits[t, layer].tolist()] if policies.miss.needs_logits else None)
            used = {e for e in plan.experts[0] if e >= 0}
            pinned = {layer * E + e for e in used}
            for e in used:
                if layer * E + e in cache.resident:
                    policies.eviction.on_access(layer * E + e)
            # Demand loads queue behind whatever the link is already doing (admissions).
            landed = clock
            for e in plan.fetch:
                landed = max(landed, link.transfer(clock))
                cache.admit(layer * E + e, pinned)
            stall = landed - clock
            compute = hw.layer_compute_s + hw.expert_compute_s * len(used)
            clock += stall + compute
            r.stall_s += stall
            r.compute_s += compute
            r.calls += k
            r.calls_hit += plan.calls_hit
            r.calls_fetched += plan.calls_fetched
            r.calls_substituted += len(plan.substituted)
            r.substituted_mass += sum(m for _, m in plan.substituted)
            for e in policies.admission.observe(layer, plan.substituted):
                # Background: occupies the link and a worker, never the compute clock.
                if cache.admit(layer * E + e, pinned):
                    link.transfer(clock)
                    r.admissions += 1
    r.evictions = cache.evictions
    return r
