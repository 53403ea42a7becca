"""The engine's metrics on /metrics: a Collector that exports the latest EngineStats snapshot
the engine process sent, so they are exactly the engine's own counters (prefix moe_offload_,
base units, 0-1 ratios)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

P = "moe_offload_"

# (metric name without prefix, snapshot key, help) for scalar engine counters.
_ENGINE_COUNTERS = (
    (
        "expert_bytes_transferred",
        "bytes_moved",
        "Bytes of expert weights copied from the slow tier to the fast tier.",
    ),
    ("expert_stall_seconds", "stall_seconds", "Seconds the forward waited on expert transfers."),
    ("expert_evictions", "evictions", "Experts evicted from the fast tier."),
    (
        "expert_calls_hit",
        "calls_hit",
        "Selected expert calls (token, slot) served from the fast tier.",
    ),
    (
        "expert_calls_fetched",
        "calls_fetched",
        "Selected expert calls that waited for a load from the slow tier.",
    ),
    (
        "expert_substitutions",
        "substitutions",
        "Selected expert calls not waited for: served by a resident stand-in or dropped.",
    ),
    (
        "expert_substituted_gate_mass",
        "substituted_mass",
        "Sum of router gate weight given to substituted experts.",
    ),
    (
        "expert_admissions",
        "admissions",
        "Experts admitted to the fast tier in the background after repeated substitution.",
    ),
    (
        "expert_transfers_cancelled",
        "transfers_cancelled",
        "Queued expert transfers cancelled before they started.",
    ),
    (
        "expert_prefetches_issued",
        "prefetch_issued",
        "Expert prefetches submitted (protected until used or expired).",
    ),
    (
        "expert_prefetches_used",
        "prefetch_used",
        "Prefetched experts used by a layer before eviction or expiry.",
    ),
    (
        "expert_prefetches_wasted",
        "prefetch_wasted",
        "Prefetched experts evicted or expired unused.",
    ),
    (
        "cpu_expert_calls",
        "cpu_expert_calls",
        "Missed experts computed by CPU workers straight from the host tier (--cpu-experts).",
    ),
    (
        "spec_drafts",
        "spec_drafts",
        "Speculative-decoding verification windows that carried proposals.",
    ),
    ("spec_draft_tokens", "spec_draft_tokens", "Speculative-decoding tokens proposed."),
    (
        "spec_accepted_tokens",
        "spec_accepted_tokens",
        "Speculative-decoding proposed tokens accepted.",
    ),
    (
        "prefix_cache_hit_tokens",
        "prefix_hit_tokens",
        "Prompt tokens read from the prefix cache instead of prefilled.",
    ),
    (
        "prefix_cache_query_tokens",
        "prefix_query_tokens",
        "Prompt tokens of requests that looked up the prefix cache (hit ratio = hit / query).",
    ),
)


class EngineStatsCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        for section in _SECTIONS:
            yield from section(self.snapshot)


def _per_layer(s: dict[str, Any]) -> Iterator[Metric]:
    """Expert hits, misses and stall seconds per MoE layer."""
    hits = CounterMetricFamily(
        P + "expert_cache_hits",
        "Expert lookups served from the fast tier, per MoE layer.",
        labels=["layer"],
    )
    misses = CounterMetricFamily(
        P + "expert_cache_misses",
        "Expert lookups not in the fast tier, per MoE layer.",
        labels=["layer"],
    )
    for row in s.get("per_layer", []):
        hits.add_metric([str(row["layer"])], row["hits"])
        misses.add_metric([str(row["layer"])], row["misses"])
    yield hits
    yield misses
    stall = CounterMetricFamily(
        P + "expert_stall_seconds_by_layer",
        "Seconds the forward waited on expert loads (or CPU-run experts), per MoE layer.",
        labels=["layer"],
    )
    for row in s.get("per_layer", []):
        if "stall_seconds" in row:
            stall.add_metric([str(row["layer"])], row["stall_seconds"])
    yield stall


def _utility_and_balancer(s: dict[str, Any]) -> Iterator[Metric]:
    """Experts per speculative utility level and the CPU/GPU balancer's decisions."""
    levels = GaugeMetricFamily(
        P + "expert_utility_level_experts",
        "Experts at each speculative utility level (0 = cold .. 3 = hot), all MoE layers.",
        labels=["level"],
    )
    for lv, n in enumerate(s.get("utility_levels", [])):
        levels.add_metric([str(lv)], n)
    yield levels
    bal = s.get("balancer") or {
        "calls": 0,
        "copied": 0,
        "missed": 0,
        "share_buckets": [0.0, 0.25, 0.5, 0.75, 1.0],
        "share_counts": [0] * 5,
    }
    buckets = [
        (f"{b:g}" if b < 1 else "+Inf", n)
        for b, n in zip(bal["share_buckets"], bal["share_counts"])
    ]
    yield HistogramMetricFamily(
        P + "balancer_tau_share",
        "CPU/GPU balancer decisions by τ/M, the share of a layer's missed experts copied to the fast device (the rest ran on the CPU).",
        buckets=buckets,
        sum_value=bal["copied"] / max(1, bal["missed"]) * bal["calls"],
    )  # sum approximated by the mean share


def _memory(s: dict[str, Any]) -> Iterator[Metric]:
    """Bytes planned and held per memory pool."""
    planned = GaugeMetricFamily(
        P + "memory_planned_bytes",
        "Bytes the memory plan gives each pool (engine/memory/planner.py).",
        labels=["pool"],
    )
    used = GaugeMetricFamily(
        P + "memory_used_bytes",
        "Bytes each pool holds now, where measured (host_total: the engine's RSS; slow_tier_pageable: host-tier bytes that could not be pinned).",
        labels=["pool"],
    )
    for pool, row in sorted(s.get("memory", {}).items()):
        if "planned" in row:
            planned.add_metric([pool], row["planned"])
        if "used" in row:
            used.add_metric([pool], row["used"])
    yield planned
    yield used


def _transfers(s: dict[str, Any]) -> Iterator[Metric]:
    """The fast tier's hit ratio, transfers by kind and the scalar engine counters."""
    yield GaugeMetricFamily(
        P + "expert_cache_hit_ratio",
        "Share of expert lookups that hit the fast tier (0-1).",
        value=s.get("hit_rate", 0.0),
    )
    transfers = CounterMetricFamily(
        P + "expert_transfers",
        "Expert transfers by kind (demand, prefetch, admission).",
        labels=["kind"],
    )
    for kind, n in sorted(s.get("transfers", {"demand": 0, "prefetch": 0, "admission": 0}).items()):
        transfers.add_metric([kind], n)
    yield transfers
    for name, key, doc in _ENGINE_COUNTERS:
        yield CounterMetricFamily(P + name, doc, value=s.get(key, 0))


def _speculation(s: dict[str, Any]) -> Iterator[Metric]:
    """Proposals and acceptances per position in the verification window."""
    proposed = CounterMetricFamily(
        P + "spec_proposed_at_position",
        "Verification windows with a proposal at this position (1 = first proposal).",
        labels=["position"],
    )
    accepted = CounterMetricFamily(
        P + "spec_accepted_at_position",
        "Proposals accepted at this position (acceptance per position = accepted / proposed).",
        labels=["position"],
    )
    for i, (pn, an) in enumerate(zip(s.get("spec_proposed_at", []), s.get("spec_accepted_at", []))):
        proposed.add_metric([str(i + 1)], pn)
        accepted.add_metric([str(i + 1)], an)
    yield proposed
    yield accepted


def _prefix_and_kv(s: dict[str, Any]) -> Iterator[Metric]:
    """The prefix cache, the KV pool, the KV/expert split and preemptions."""
    yield GaugeMetricFamily(
        P + "prefix_cache_bytes",
        "Bytes of prompt KV the prefix cache holds (bounded by --prefix-cache-bytes).",
        value=s.get("prefix_bytes", 0),
    )
    yield GaugeMetricFamily(
        P + "prefix_cache_blocks",
        "Prompt blocks (16 tokens each) the prefix cache holds.",
        value=s.get("prefix_blocks", 0),
    )
    yield GaugeMetricFamily(
        P + "prefix_cache_snapshots",
        "Conversation snapshots the prefix cache holds (hybrid and sliding-window models).",
        value=s.get("prefix_snapshots", 0),
    )
    yield _labelled_gauge(
        "kv_blocks",
        "KV pool blocks (16 positions each) by state: in use by requests, cached (a prefix no running "
        "request holds, reusable until evicted), total.",
        "state",
        zip(("in_use", "cached", "total"), s.get("kv_blocks", (0, 0, 0))),
    )
    yield GaugeMetricFamily(
        P + "kv_block_bytes",
        "Bytes of one KV pool block, every layer's keys and values (0: requests keep their own buffers).",
        value=s.get("kv_block_bytes", 0),
    )
    yield _labelled_gauge(
        "memory_split_bytes",
        "One budget split between the KV pool's blocks and the experts' fast-tier slots, in bytes; under load "
        "the KV pool borrows expert slots, idle they go back (--kv-borrow-share).",
        "part",
        zip(("kv", "experts"), s.get("memory_split", (0, 0))),
    )
    yield CounterMetricFamily(
        P + "memory_split_moves",
        "Times memory moved between the KV pool and the experts' fast tier (lends and give-backs).",
        value=s.get("memory_split_moves", 0),
    )
    yield CounterMetricFamily(
        P + "preemptions",
        "Requests whose KV blocks were taken back when the pool ran out; each resumed by recomputing.",
        value=s.get("preemptions", 0),
    )


def _spec_windows(s: dict[str, Any]) -> Iterator[Metric]:
    """Mean accepted length and distinct experts per verification window."""
    yield GaugeMetricFamily(
        P + "spec_mean_accepted_length",
        "Mean proposals accepted per verification window, since start.",
        value=s.get("spec_mean_accepted_length", 0.0),
    )
    distinct = GaugeMetricFamily(
        P + "spec_distinct_experts_per_window",
        "Mean distinct experts a verification window routes to, per MoE layer (one token routes to top_k).",
        labels=["layer"],
    )
    for row in s.get("per_layer", []):
        if row.get("distinct_experts_per_window"):
            distinct.add_metric([str(row["layer"])], row["distinct_experts_per_window"])
    yield distinct


def _steps(s: dict[str, Any]) -> Iterator[Metric]:
    """Forwards by step kind and path, and why steps declined the fused path."""
    steps = CounterMetricFamily(
        P + "decode_steps",
        "Engine forwards by step kind (prefill, decode, verify) and the path they took (fused: one native call a decoder layer; lean: layer by layer; transformers).",
        labels=["kind", "path"],
    )
    for kind, paths in sorted(s.get("steps", {}).items()):
        for path, n in sorted(paths.items()):
            steps.add_metric([kind, path], n)
    yield steps
    declined = CounterMetricFamily(
        P + "fused_declined_steps",
        "Layer-by-layer steps by why they did not take the fused path (several requests, several rows, experts can miss, ...).",
        labels=["reason"],
    )
    for reason, n in sorted(s.get("fused_declined", {}).items()):
        declined.add_metric([reason], n)
    yield declined


_SECTIONS = (
    _per_layer,
    _utility_and_balancer,
    _memory,
    _transfers,
    _speculation,
    _prefix_and_kv,
    _spec_windows,
    _steps,
)


def _labelled_gauge(
    name: str, doc: str, label: str, values: Iterable[tuple[str, float]]
) -> GaugeMetricFamily:
    """A gauge family with one sample per (label value, value)."""
    family = GaugeMetricFamily(P + name, doc, labels=[label])
    for value_label, value in values:
        family.add_metric([value_label], value)
    return family
