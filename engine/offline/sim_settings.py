"""What the router-trace simulator (engine/offline/simulator.py) takes and gives: its settings, the
acceptance model of speculative windows, the next-layer predictor hook, its result, and traces
read from disk."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.offline.hardware import Costs

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
    balancer_level: int | None = None  # as EngineConfig.balancer_level: None, the optimized τ
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
    predictor_budget: int | None = (
        None  # prefetches per layer and step from the predictor (default: top-k)
    )


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
                setattr(
                    self,
                    f.name,
                    getattr(self, f.name) - (getattr(after, f.name) - getattr(before, f.name)),
                )

    @property
    def seconds(self) -> float:
        return self.stall_s + self.compute_s + self.draft_s

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / max(self.tokens, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        calls = max(self.calls, 1)
        d.update(
            simulated=True,
            tokens_per_s=self.tokens / self.seconds if self.seconds else float("inf"),
            hit_share=self.calls_hit / calls,
            fetched_per_token=self.calls_fetched / max(self.tokens, 1),
            substituted_per_token=self.calls_substituted / max(self.tokens, 1),
            mean_substituted_mass=self.substituted_mass / max(self.token_layers, 1),
            stall_share=self.stall_s / self.seconds if self.seconds else 0.0,
            loads_per_token=self.demand_loads / max(self.tokens, 1),
            tokens_per_verification=self.verified_tokens / self.verifications
            if self.verifications
            else 1.0,
            prefetch_precision=self.prefetch_used / (self.prefetch_used + self.prefetch_wasted)
            if self.prefetch_used + self.prefetch_wasted
            else float("nan"),
            prefetch_recall=self.prefetch_used / (self.prefetch_used + self.demand_loads)
            if self.prefetch_used + self.demand_loads
            else float("nan"),
            token_layers_per_s=self.token_layers / self.replay_s if self.replay_s else float("nan"),
        )
        return d


def load_trace(path: str | Path) -> dict:
    z = np.load(path)
    return trace_from_arrays({k: z[k] for k in z.files})


def trace_from_arrays(arrays: dict) -> dict:
    """A trace as the simulator reads it, from the arrays record_trace returns or a saved .npz holds
    (its meta, stored as a JSON string, parsed)."""
    return {**arrays, "meta": json.loads(str(arrays["meta"]))}


def manual_costs(
    link_mb_per_s: float,
    latency_us: float,
    expert_bytes: int,
    layer_compute_s: float,
    expert_compute_s: float,
    workers: int = 2,
) -> Costs:
    """Costs from a few flat numbers (no profile): dense and per-expert time independent of rows."""
    return Costs(
        profile=f"manual ({link_mb_per_s:g} MB/s + {latency_us:g} us)",
        shape="trace",
        expert_bytes=expert_bytes,
        link_mb_per_s=link_mb_per_s,
        link_latency_s=latency_us * 1e-6,
        transfer_workers=workers,
        fast=(expert_compute_s, 0.0),
        cpu=(expert_compute_s, 0.0),
        cpu_workers=2,
        dense=(layer_compute_s, 0.0),
        notes=("manual",),
    )
