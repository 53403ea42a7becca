"""Counters kept at the source (store, transfer engine, MoE layer) and exported as one object.

One lock guards everything: increments are rare relative to compute (a few per layer per
step), so contention is negligible and snapshots are always self-consistent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

TRANSFER_KINDS = ("demand", "prefetch", "admission")
SHARE_BUCKETS = (
    0.0,
    0.25,
    0.5,
    0.75,
    1.0,
)  # upper bounds of τ/M: the share of missed experts copied


@dataclass
class EngineStats:
    num_layers: int
    hits: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    stall_seconds: float = 0.0
    transfers: dict[str, int] = field(default_factory=dict)
    transfer_seconds: dict[str, float] = field(default_factory=dict)
    transfers_cancelled: int = 0
    evictions: int = 0
    calls_hit: int = 0  # selected (token, slot) expert calls served from the fast tier
    calls_fetched: int = 0  # ... served by waiting for a load
    substitutions: int = 0  # ... served by a stand-in (or dropped)
    substituted_mass: float = 0.0
    admissions: int = 0
    prefetch_issued: int = 0  # protected prefetch transfers submitted
    prefetch_used: int = 0  # ... whose expert a plan used (or a demand load joined) before expiry
    prefetch_wasted: int = 0  # ... evicted or expired unused
    spec_drafts: int = 0  # verification windows that carried proposals
    spec_draft_tokens: int = 0  # proposals made
    spec_accepted_tokens: int = 0  # proposals accepted
    spec_proposed_at: list[int] = field(
        default_factory=list
    )  # [position] windows with a proposal at that position
    spec_accepted_at: list[int] = field(default_factory=list)  # [position] ... accepted there
    window_distinct_experts: list[int] = field(
        default_factory=list
    )  # [layer] sum over windows of distinct experts
    windows_seen: list[int] = field(default_factory=list)  # [layer] verification windows counted
    stall_by_layer: list[float] = field(default_factory=list)  # [layer] stall seconds
    cpu_expert_calls: int = 0  # missed experts computed by CPU workers from the host tier
    balancer_calls: int = 0  # layer runs where the CPU/GPU balancer split the misses
    balancer_copied: int = 0  # ... missed experts it sent to the fast device (sum of τ)
    balancer_missed: int = 0  # ... missed experts it split (sum of M)
    balancer_share: list[int] = field(
        default_factory=lambda: [0] * len(SHARE_BUCKETS)
    )  # calls by τ/M, cumulative buckets
    utility_levels: list[int] = field(default_factory=list)  # experts at each utility level, latest
    # Forwards by step kind (prefill, decode, verify, forward) and path (fused, lean, transformers:
    # engine/worker/dispatch.py), and the lean steps' reasons for not taking the fused one.
    steps: dict[str, dict[str, int]] = field(default_factory=dict)
    fused_declined: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: int = (
        0  # prompt tokens served from the prefix cache (engine/worker/prefix_cache.py)
    )
    prefix_query_tokens: int = 0  # prompt tokens of the requests that looked it up
    prefix_bytes: int = 0  # bytes of KV it holds now
    prefix_blocks: int = 0  # blocks it holds now
    prefix_snapshots: int = (
        0  # conversation snapshots it holds now (engine/worker/session_cache.py)
    )
    # The paged KV pool (engine/core/kv_blocks.py): blocks in use, cached (unreferenced prefixes) and
    # total, its bytes a block (0 where requests keep their own buffers), preemptions since start.
    kv_blocks: tuple[int, int, int] = (0, 0, 0)
    kv_block_bytes: int = 0
    preemptions: int = 0
    # The KV/expert split (engine/memory/split.py): bytes of the KV pool's blocks and of the fast tier's slots
    # in use now, and how many times memory moved between them.
    memory_split: tuple[int, int] = (0, 0)
    memory_split_moves: int = 0
    memory_probe: Any = field(
        default=None, repr=False, compare=False
    )  # engine/memory/measure.py memory_probe
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.hits:
            self.hits = [0] * self.num_layers
            self.misses = [0] * self.num_layers
            self.window_distinct_experts = [0] * self.num_layers
            self.windows_seen = [0] * self.num_layers
            self.stall_by_layer = [0.0] * self.num_layers
        for kind in TRANSFER_KINDS:
            self.transfers.setdefault(kind, 0)
            self.transfer_seconds.setdefault(kind, 0.0)

    def reset(self) -> None:
        """Zero every counter (e.g. after warm-up, or between benchmark phases)."""
        fresh = EngineStats(self.num_layers)
        with self._lock:
            for f in fields(self):
                if f.name not in ("num_layers", "_lock", "memory_probe"):
                    setattr(self, f.name, getattr(fresh, f.name))

    def record_lookups(self, layer: int, hits: int, misses: int) -> None:
        with self._lock:
            self.hits[layer] += hits
            self.misses[layer] += misses

    def record_all_hits(self, layer: int, calls: int) -> None:
        """One layer of a step whose `calls` selected experts were all resident: record_lookups() and
        the hit calls of add(), under one lock acquisition."""
        with self._lock:
            self.hits[layer] += calls
            self.calls_hit += calls

    def record_step(self, kind: str, path: str, declined: str = "") -> None:
        """One forward of `kind` took `path`; `declined`: why not the fused path ("" where it was, or where
        the model has none)."""
        with self._lock:
            by_path = self.steps.setdefault(kind, {})
            by_path[path] = by_path.get(path, 0) + 1
            if declined and path == "lean":
                self.fused_declined[declined] = self.fused_declined.get(declined, 0) + 1

    def record_window(self, proposed: int, accepted: int) -> None:
        """One verification window: `proposed` tokens, the first `accepted` of them kept."""
        with self._lock:
            grow = proposed - len(self.spec_proposed_at)
            if grow > 0:
                self.spec_proposed_at += [0] * grow
                self.spec_accepted_at += [0] * grow
            self.spec_drafts += 1
            self.spec_draft_tokens += proposed
            self.spec_accepted_tokens += accepted
            for i in range(proposed):
                self.spec_proposed_at[i] += 1
                self.spec_accepted_at[i] += i < accepted

    def record_window_experts(self, layer: int, distinct: int) -> None:
        with self._lock:
            self.window_distinct_experts[layer] += distinct
            self.windows_seen[layer] += 1

    def record_transfer(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.transfers[kind] += 1
            self.transfer_seconds[kind] += seconds
            self.bytes_moved += nbytes

    def record_cancel(self) -> None:
        with self._lock:
            self.transfers_cancelled += 1

    def record_stall(self, seconds: float, layer: int | None = None) -> None:
        with self._lock:
            self.stall_seconds += seconds
            if layer is not None and 0 <= layer < len(self.stall_by_layer):
                self.stall_by_layer[layer] += seconds

    def record_balancer(self, copied: int, missed: int) -> None:
        """One CPU/GPU split: `copied` of `missed` experts go to the fast device (τ)."""
        share = copied / missed if missed else 1.0
        with self._lock:
            self.balancer_calls += 1
            self.balancer_copied += copied
            self.balancer_missed += missed
            for i, bound in enumerate(SHARE_BUCKETS):
                self.balancer_share[i] += share <= bound

    def set_utility_levels(self, histogram: list[int]) -> None:
        with self._lock:
            self.utility_levels = list(histogram)

    def set_prefix_cache(
        self, hit_tokens: int, query_tokens: int, nbytes: int, blocks: int
    ) -> None:
        with self._lock:
            (
                self.prefix_hit_tokens,
                self.prefix_query_tokens,
                self.prefix_bytes,
                self.prefix_blocks,
            ) = hit_tokens, query_tokens, nbytes, blocks

    def set_prefix_snapshots(self, snapshots: int) -> None:
        with self._lock:
            self.prefix_snapshots = snapshots

    def set_kv_pool(self, counts: Any, preemptions: int, block_bytes: int) -> None:
        with self._lock:
            self.kv_blocks = (counts.in_use, counts.cached, counts.total)
            self.preemptions, self.kv_block_bytes = preemptions, block_bytes

    def set_memory_split(self, kv_bytes: int, expert_bytes: int, moves: int) -> None:
        with self._lock:
            self.memory_split, self.memory_split_moves = (kv_bytes, expert_bytes), moves

    def record_eviction(self) -> None:
        with self._lock:
            self.evictions += 1

    def add(self, **deltas: float) -> None:
        """Add to scalar counters by name, e.g. `stats.add(substitutions=3, substituted_mass=0.4)`."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy, safe to send across a process boundary or print as JSON."""
        with self._lock:
            total_hits, total_misses = sum(self.hits), sum(self.misses)
            lookups = total_hits + total_misses
            return {
                "hits": total_hits,
                "misses": total_misses,
                "hit_rate": total_hits / lookups if lookups else 0.0,
                "bytes_moved": self.bytes_moved,
                "stall_seconds": self.stall_seconds,
                "transfers": dict(self.transfers),
                "transfer_seconds": dict(self.transfer_seconds),
                "transfers_cancelled": self.transfers_cancelled,
                "evictions": self.evictions,
                "calls_hit": self.calls_hit,
                "calls_fetched": self.calls_fetched,
                "substitutions": self.substitutions,
                "substituted_mass": self.substituted_mass,
                "admissions": self.admissions,
                "prefetch_issued": self.prefetch_issued,
                "prefetch_used": self.prefetch_used,
                "prefetch_wasted": self.prefetch_wasted,
                "spec_drafts": self.spec_drafts,
                "spec_draft_tokens": self.spec_draft_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens,
                "spec_mean_accepted_length": self.spec_accepted_tokens / self.spec_drafts
                if self.spec_drafts
                else 0.0,
                "spec_acceptance_by_position": [
                    a / p if p else 0.0
                    for a, p in zip(self.spec_accepted_at, self.spec_proposed_at)
                ],
                "spec_accepted_at": list(self.spec_accepted_at),
                "spec_proposed_at": list(self.spec_proposed_at),
                "cpu_expert_calls": self.cpu_expert_calls,
                "balancer": {
                    "calls": self.balancer_calls,
                    "copied": self.balancer_copied,
                    "missed": self.balancer_missed,
                    "share_buckets": list(SHARE_BUCKETS),
                    "share_counts": list(self.balancer_share),
                },
                "utility_levels": list(self.utility_levels),
                "steps": {kind: dict(paths) for kind, paths in self.steps.items()},
                "fused_declined": dict(self.fused_declined),
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_bytes": self.prefix_bytes,
                "prefix_blocks": self.prefix_blocks,
                "prefix_snapshots": self.prefix_snapshots,
                "kv_blocks": self.kv_blocks,
                "memory_split": self.memory_split,
                "memory_split_moves": self.memory_split_moves,
                "kv_block_bytes": self.kv_block_bytes,
                "preemptions": self.preemptions,
                "memory": self.memory_probe() if self.memory_probe is not None else {},
                "per_layer": [
                    {
                        "layer": i,
                        "hits": h,
                        "misses": m,
                        "stall_seconds": self.stall_by_layer[i],
                        "distinct_experts_per_window": self.window_distinct_experts[i]
                        / self.windows_seen[i]
                        if self.windows_seen[i]
                        else 0.0,
                    }
                    for i, (h, m) in enumerate(zip(self.hits, self.misses))
                ],
            }
