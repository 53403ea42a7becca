"""Seed 004's SIMULATED figures (engine/offline/): the router trace of the embedded model replayed
under MoE-SpAc's configurations, on this machine's measured profile and PROJECTED onto the paper's
hardware and model (RTX 4090 over PCIe 4.0, Qwen3-30B-A3B), and the crossover grid that says where
speculation would pay: per link time and per compute of an extra window row.

Every configuration is exact (fetch-all): the comparison is the seed's, speculation-as-sensor
against the best exact decoding without it. Speculative cells use a fixed k = 4 (adaptive k turns
speculation off on this machine, docs/benchmarks/spac.md) unless named "adaptive"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine import (
    SHAPES,
    Acceptance,
    Costs,
    EngineConfig,
    SimSettings,
    Simulator,
    costs_for,
    project_trace,
)

UTILITY = {"prefetch": "utility", "eviction": "utility"}
SPEC = {"speculative": True, "adaptive": False, "k": 4}
# label -> (EngineConfig overrides, SimSettings overrides); the measured table uses the same labels.
SIM_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({"eviction": "lru"}, {}),
    "plain reuse": ({}, {}),
    "plain+cpu": ({"cpu_experts": "auto"}, {"cpu_experts": "auto"}),
    "spec adaptive+utility+cpu": (
        {**UTILITY, "cpu_experts": "auto"},
        {"speculative": True, "prefetch": "utility", "cpu_experts": "auto"},
    ),
    "spec": ({"eviction": "lru"}, SPEC),
    "spec+utility": (UTILITY, {**SPEC, "prefetch": "utility"}),
    "spec+utility prefetch only": (
        {"prefetch": "utility", "eviction": "lru"},
        {**SPEC, "prefetch": "utility"},
    ),
    "spec+utility eviction only": ({"eviction": "utility"}, SPEC),
    "spec+utility+cpu": (
        {**UTILITY, "cpu_experts": "auto"},
        {**SPEC, "prefetch": "utility", "cpu_experts": "auto"},
    ),
    "spec+cpu, no utility": (
        {"eviction": "lru", "cpu_experts": "auto"},
        {**SPEC, "cpu_experts": "auto"},
    ),
    **{
        f"spec+utility+cpu fixed level {lv}": (
            {**UTILITY, "cpu_experts": "auto"},
            {**SPEC, "prefetch": "utility", "cpu_experts": "auto", "balancer_level": lv},
        )
        for lv in (1, 2, 3)
    },
}
NON_SPEC = ("plain", "plain reuse", "plain+cpu")
SPEC_EXACT = ("spec", "spec+utility", "spec+utility+cpu")


def simulate(
    trace: dict, costs: Costs, label: str, cache: float, tokens: int, **extra: Any
) -> dict[str, Any]:
    """One SIMULATED configuration: its result dict (tokens_per_s, loads_per_token, ...)."""
    pol, st = SIM_CONFIGS[label]
    settings = SimSettings(cache_fraction=cache, max_tokens=tokens, **{**st, **extra})
    return Simulator(trace, EngineConfig(**pol).policies(), costs, settings).run().to_dict()


def _row(label: str, res: dict[str, Any], base: dict[str, Any], **keys: Any) -> dict[str, Any]:
    return {
        "config": label,
        **keys,
        "tok_s": res["tokens_per_s"],
        "vs_plain": res["tokens_per_s"] / base["tokens_per_s"],
        "tokens_per_verification": res["tokens_per_verification"],
        "loads_per_token": res["loads_per_token"],
        "stall_share": res["stall_share"],
        "cpu_calls_per_token": res["cpu_expert_calls"] / max(res["tokens"], 1),
        "prefetch_precision": res["prefetch_precision"],
        "prefetches_per_token": res["prefetch_issued"] / max(res["tokens"], 1),
    }


def config_table(
    trace: dict, costs: Costs, labels: Sequence[str], cache: float, tokens: int, **extra: Any
) -> list[dict[str, Any]]:
    """Each configuration at one cache fraction, with its ratio to `plain` (simulated)."""
    res = {
        label: simulate(trace, costs, label, cache, tokens, **extra) for label in ("plain", *labels)
    }
    return [_row(label, res[label], res["plain"], cache=cache) for label in labels]


def cache_sweep(
    trace: dict, costs: Costs, labels: Sequence[str], caches: Sequence[float], tokens: int
) -> list[dict[str, Any]]:
    return [r for c in caches for r in config_table(trace, costs, labels, c, tokens)]


def long_generation(
    trace: dict, costs: Costs, labels: Sequence[str], lengths: Sequence[int], cache: float
) -> list[dict[str, Any]]:
    """tok/s per request length (one request of each length, prompt excluded; simulated)."""
    out = []
    for n in lengths:
        res = {
            label: simulate(trace, costs, label, cache, n, request_tokens=n)
            for label in ("plain", *labels)
        }
        out += [_row(label, res[label], res["plain"], tokens=n) for label in labels]
    return out


def projected_costs(trace: dict, profile: str, shape: str) -> tuple[dict, Costs]:
    """The trace projected onto `shape` and `profile`'s costs for it (PROJECTED figures)."""
    return project_trace(trace, shape), costs_for(profile, SHAPES[shape])


def scaled_costs(base: Costs, load_ms: float, row_share: float, draft_scale: float) -> Costs:
    """`base` with one expert load taking `load_ms` (latency; bandwidth as in base), every extra
    row of a step costing `row_share` of the first row's compute (0: rows are free, as for a GPU's
    GEMM at decode sizes; 1: each row costs as much as the first, as for a CPU's), and the draft's
    cost per proposed token scaled by `draft_scale`."""
    d1, g1 = base.d(1), base.g(1)
    transfer = base.expert_bytes / (base.link_mb_per_s * 1e6)
    return replace(
        base,
        link_latency_s=max(load_ms * 1e-3 - transfer, 0.0),
        dense_points=None,
        dense=(d1 * (1 - row_share), d1 * row_share),
        dense_extra_row=None,
        fast=(g1 * (1 - row_share), g1 * row_share),
        draft_token_s=base.draft_token_s * draft_scale,
    )


def acceptance_for(spec: str) -> Acceptance:
    """'bench': the per-position acceptance measured on the spec benchmark's prompts (about 1.9
    tokens a verification at k = 4); a number a: a geometric one, P(run >= i) = a**i."""
    if spec == "bench":
        return Acceptance()
    a = float(spec)
    return Acceptance(tuple(a**i for i in range(1, 5)))


def panel_label(draft_scale: float, acceptance: str) -> str:
    acc = "the spec bench's" if acceptance == "bench" else f"{acceptance} a position"
    return f"draft {draft_scale:g}× measured, acceptance {acc}"


def crossover(
    trace: dict,
    base: Costs,
    loads_ms: Sequence[float],
    row_shares: Sequence[float],
    panels: Sequence[tuple[float, str]],
    cache: float,
    tokens: int,
) -> list[dict[str, Any]]:
    """Per panel (draft cost scale, acceptance) and grid point: the best exact speculative
    configuration's tok/s over the best exact non-speculative one's (SIMULATED). > 1: speculation
    as a sensor pays there."""
    out = []
    for ds, acc in panels:
        for share in row_shares:
            for ms in loads_ms:
                c = scaled_costs(base, ms, share, ds)
                plain = {lb: simulate(trace, c, lb, cache, tokens) for lb in NON_SPEC}
                spec = {
                    lb: simulate(trace, c, lb, cache, tokens, acceptance=acceptance_for(acc))
                    for lb in SPEC_EXACT
                }
                bp = max(plain, key=lambda lb: plain[lb]["tokens_per_s"])
                bs = max(spec, key=lambda lb: spec[lb]["tokens_per_s"])
                out.append(
                    {
                        "panel": panel_label(ds, acc),
                        "draft_scale": ds,
                        "acceptance": acc,
                        "row_share": share,
                        "load_ms": ms,
                        "best_plain": bp,
                        "best_plain_tok_s": plain[bp]["tokens_per_s"],
                        "best_spec": bs,
                        "best_spec_tok_s": spec[bs]["tokens_per_s"],
                        "ratio": spec[bs]["tokens_per_s"] / plain[bp]["tokens_per_s"],
                        "tokens_per_verification": spec[bs]["tokens_per_verification"],
                    }
                )
    return out
