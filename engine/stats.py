"""Counters kept at the source (store, transfer engine, MoE layer) and exported as one object.

One lock guards everything: increments are rare relative to compute (a few per layer per
step), so contention is negligible and snapshots are always self-consistent.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

TRANSFER_KINDS = ("demand", "prefetch", "admission")


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.hits:
            self.hits = [0] * self.num_layers
            self.misses = [0] * self.num_layers
        for kind in TRANSFER_KINDS:
            self.transfers.setdefault(kind, 0)
            self.transfer_seconds.setdefault(kind, 0.0)

    def reset(self) -> None:
        """Zero every counter (e.g. after warm-up, or between benchmark phases)."""
        fresh = EngineStats(self.num_layers)
        with self._lock:
            for f in fields(self):
                if f.name not in ("num_layers", "_lock"):
                    setattr(self, f.name, getattr(fresh, f.name))

    def record_lookups(self, layer: int, hits: int, misses: int) -> None:
        with self._lock:
            self.hits[layer] += hits
            self.misses[layer] += misses

    def record_transfer(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.transfers[kind] += 1
            self.transfer_seconds[kind] += seconds
            self.bytes_moved += nbytes

    def record_cancel(self) -> None:
        with self._lock:
            self.transfers_cancelled += 1

    def record_stall(self, seconds: float) -> None:
        with self._lock:
            self.stall_seconds += seconds

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
                "per_layer": [
                    {"layer": i, "hits": h, "misses": m} for i, (h, m) in enumerate(zip(self.hits, self.misses))
                ],
            }
