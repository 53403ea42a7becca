"""The fast tier: a fixed pool of expert slots and the residency map.

Each slot is one contiguous row of a preallocated [n_slots, numel] tensor on the compute
device, so loading an expert is one copy and nothing is allocated on the hot path.

Keys are ints (layer * num_experts + expert) to keep the per-layer bookkeeping cheap.
A key is in one of two states: LOADING (slot reserved, copy in flight) or RESIDENT.

The rules (reserve, evict, pin, protect, tick) are engine/experts/tiers/residency.py's, tensor-free,
which the router-trace simulator replays too; this class adds the slot tensor, the lock and the
engine's counters. Every method takes `lock`, which is also the transfer engine's queue lock, so
a plan that reads residency and pins what it uses is atomic with respect to every thread that evicts.
"""

from __future__ import annotations

import threading
from collections import Counter
from enum import Enum
from types import TracebackType
from typing import cast

import torch

from engine.experts.tiers.residency import INF, LANDED, EvictableView, Residency
from engine.huge_pages import empty, release_pages
from engine.stats import EngineStats
from policies.base import EvictionPolicy

__all__ = ["EvictableView", "ExpertLease", "ExpertStore", "SlotState"]


class SlotState(Enum):
    LOADING = "loading"
    RESIDENT = "resident"


class ExpertLease:
    """Pins held by one user of the fast tier (one MoE layer's run).

    `with store.lease() as lease:` always unpins what is still held on exit, including on
    exceptions, so a failed read or an aborted step can never leave slots pinned for good.
    """

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self.held: Counter[int] = Counter()

    def pin(self, key: int) -> None:
        self.store.pin(key)
        self.held[key] += 1

    def pin_all(self, keys: list[int]) -> None:
        """pin() of each key, under one lock acquisition (a layer's whole plan at once)."""
        self.store.pin_all(keys)
        self.held.update(keys)

    def adopt(self, key: int) -> None:
        """Take over a pin someone already took on our behalf (a demand load's consumer pin)."""
        self.held[key] += 1

    def release(self, key: int) -> None:
        """Unpin early, e.g. to free the slot for the next load of a layer that streams."""
        if self.held[key] > 0:
            self.held[key] -= 1
            self.store.unpin(key)

    def __enter__(self) -> ExpertLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.store.unpin_all(self.held)
        self.held.clear()


class ExpertStore:
    def __init__(
        self,
        n_slots: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        eviction: EvictionPolicy,
        stats: EngineStats,
        protect_ticks: int = 16,
        slots: torch.Tensor | None = None,
        huge_pages: bool = False,
    ) -> None:
        # protect_ticks: how many MoE layer runs a prefetched expert is protected for.
        self.res = Residency(
            n_slots,
            eviction,
            protect_ticks,
            on_evict=stats.record_eviction,
            on_waste=lambda n: stats.add(prefetch_wasted=n),
        )
        self.n_slots = n_slots
        # [n_slots, 3*I*H]; `slots` given: an existing buffer serves as the pool (zero-copy, see adopt).
        self.slots = (
            slots if slots is not None else empty((n_slots, numel), dtype, huge_pages, device)
        )
        self.eviction = eviction
        self.stats = stats
        self._ready = (
            self.res.ready
        )  # the same dict: is_resident runs for every expert of every plan
        self.lock = threading.RLock()
        # Every expert of the model resident in a slot of its own, for good: the zero-copy pool
        # (adopt), or a fast tier as big as the model once filled (mark_complete). Nothing can
        # miss, load or be evicted any more, which lets a decode step skip the bookkeeping that
        # only matters for those (MoeExecutor's resident lane).
        self.complete = False

    @property
    def protect_ticks(self) -> int:
        return self.res.protect_ticks

    @property
    def slot_bytes(self) -> int:
        return self.slots.shape[1] * self.slots.element_size()

    # -- queries ---------------------------------------------------------------
    def is_resident(self, key: int) -> bool:
        return self._ready.get(key, INF) <= 0.0

    def state(self, key: int) -> SlotState | None:
        t = self._ready.get(key)
        return None if t is None else SlotState.LOADING if t == INF else SlotState.RESIDENT

    def slot_index(self, key: int) -> int:
        return self.res.slot_of[key]

    def weights(self, key: int) -> torch.Tensor:
        """The flat buffer of a resident (or just-loaded) expert."""
        return self.slots[self.res.slot_of[key]]

    def pinned_count(self) -> int:
        with self.lock:
            return len(self.res.pins)

    def has_room(self) -> bool:
        """A demand load could get a slot now (free, or an unpinned resident to evict)."""
        with self.lock:
            return bool(
                self.res.free
                or self.res.evictable(protected=False)
                or self.res.evictable(protected=True)
            )

    def is_protected(self, key: int) -> bool:
        return key in self.res.protected

    def has_free_slot(self) -> bool:
        return bool(self.res.free)

    def next_victim(self) -> int | None:
        """The expert a prefetch would evict if no slot were free, or None when nothing can go.
        Callers hold `lock` when they act on the answer."""
        with self.lock:
            return cast(
                "int | None", self.eviction.victim(self.res.evictable(protected=False))
            )  # keys are ints

    def free_or_evictable(self) -> int:
        """Slots a layer could take now without waiting: free ones plus unpinned residents."""
        with self.lock:
            return self.res.free_or_evictable()

    # -- pinning ---------------------------------------------------------------
    def lease(self) -> ExpertLease:
        return ExpertLease(self)

    def pin(self, key: int) -> None:
        with self.lock:
            self.res.pin_all((key,))

    def pin_all(self, keys: list[int]) -> None:
        with self.lock:
            self.res.pin_all(keys)

    def unpin(self, key: int) -> None:
        self.unpin_all({key: 1})

    def unpin_all(self, counts: dict[int, int]) -> None:
        """Drop `counts[key]` pins of each key, under one lock acquisition."""
        with self.lock:
            self.res.unpin_all(counts)

    def touch(self, key: int) -> None:
        """A plan uses this resident expert: tell the eviction policy; a prefetch pays off."""
        self.touch_all([key])

    def touch_all(self, keys: list[int]) -> None:
        """touch() of each key in order, under one lock acquisition."""
        with self.lock:
            used = self.res.touch_all(keys)
            if used:
                self.stats.add(prefetch_used=used)

    def refresh(self, keys: list[int]) -> None:
        """A predictor expects these residents to be used soon: count it as a use for the eviction
        policy's ranking, so the prefetches made for the same layer do not evict them first."""
        with self.lock:
            for key in keys:
                if self.is_resident(key):
                    self.eviction.on_access(key)

    # -- protection of prefetched experts -----------------------------------------
    def protect(self, key: int) -> None:
        """Shield a prefetched expert from eviction until it is used or `protect_ticks` pass."""
        with self.lock:
            self.res.protect(key)

    def begin_layer(self, layer: int) -> None:
        """An MoE layer starts planning: the eviction policy learns where the forward is."""
        with self.lock:
            self.eviction.on_layer(layer)

    def tick(self) -> None:
        """One MoE layer ran: expire protections that were never used (wasted prefetches)."""
        with self.lock:
            self.res.tick()

    def adopt(self, rows: dict[int, int]) -> None:
        """Zero-copy: every key is resident in row rows[key] of the pool, which is the slow tier's
        own buffer (both tiers host memory, cache 1.0): nothing is ever copied or evicted."""
        with self.lock:
            self.res.adopt(rows)
            self.complete = True

    def mark_complete(self, keys: int) -> bool:
        """Set `complete` where this store has a slot for each of the model's `keys` experts and
        every slot holds a resident one (a fast tier as big as the model, filled). Returns it."""
        with self.lock:
            resident = sum(t <= 0.0 for t in self._ready.values())
            self.complete = self.res.capacity >= keys and resident == keys
            return self.complete

    # -- lending slots to the KV pool (engine/memory/split.py) -------------------------------------
    def withdraw(self, n: int) -> int:
        """Take up to `n` slots out of use (free ones, then the eviction policy's victims, evicted the normal
        way) and give their pages back to the OS; returns how many. Nothing in use is touched: pinned and
        loading experts keep their slots."""
        with self.lock:
            taken = self.res.withdraw(n)
            if taken:
                self.complete = False
        for slot in taken:  # out of every list: no thread reads or writes these rows now
            release_pages(self.slots[slot])
        return len(taken)

    def restore(self, n: int) -> int:
        """Put up to `n` lent slots back (free: misses and prefetches fill them as usual); returns how many."""
        with self.lock:
            return len(self.res.restore(n))

    @property
    def capacity(self) -> int:
        return self.res.capacity

    # -- slot lifecycle (called by the transfer engine) -------------------------
    def reserve(self, key: int, may_evict_protected: bool = True) -> int | None:
        """Claim a slot for `key` (state LOADING, pinned). Evicts an unpinned resident if needed:
        unprotected ones first; protected ones only when `may_evict_protected` (demand loads).

        Returns the slot index, or None if nothing can be evicted.
        """
        with self.lock:
            return self.res.reserve(key, may_evict_protected)

    def commit(self, key: int) -> None:
        """A load finished: the expert is resident (still pinned by its loader until released)."""
        with self.lock:
            self.res.land(key, LANDED)

    def abort(self, key: int) -> None:
        """A load was cancelled or failed: give the slot back (and every pin on it)."""
        with self.lock:
            self.res.abort(key)
