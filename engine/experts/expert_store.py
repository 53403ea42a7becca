"""The fast tier: a fixed pool of expert slots and the residency map.

Each slot is one contiguous row of a preallocated [n_slots, numel] tensor on the compute
device, so loading an expert is one copy and nothing is allocated on the hot path.

Keys are ints (layer * num_experts + expert) to keep the per-layer bookkeeping cheap.
A key is in one of two states: LOADING (slot reserved, copy in flight) or RESIDENT.

Three things keep a resident expert from being evicted:
- a pin: it is in use by the current layer (held through an `ExpertLease`), or being loaded;
- protection: it was prefetched and has not been used yet (a separate protection set, as in
  MoE-Infinity's expert cache), until it is used or its protection expires;
- the eviction policy's ranking among everything else.
Every method takes `lock`, which is also the transfer engine's queue lock, so a plan that
reads residency and pins what it uses is atomic with respect to every thread that evicts.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from enum import Enum
from types import TracebackType

import torch

from engine.stats import EngineStats
from policies.base import EvictionPolicy


class SlotState(Enum):
    LOADING = "loading"
    RESIDENT = "resident"


class EvictableView(AbstractSet[int]):
    """The residents an eviction may take right now (resident, unpinned, protected or not as
    asked), as a live view over the store: a policy that walks its own order (LRU, reuse
    distance) asks `key in view` for a few keys instead of the store listing every resident
    for each eviction. Read under the store's lock, like everything else here."""

    def __init__(self, store: ExpertStore, protected: bool) -> None:
        self._store, self._protected = store, protected

    def __contains__(self, key: object) -> bool:
        st = self._store
        return (st._state.get(key) is SlotState.RESIDENT and key not in st._pins  # type: ignore[arg-type]
                and (key in st._protected) == self._protected)

    def __iter__(self) -> Iterator[int]:
        return (k for k in list(self._store._state) if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return any(True for _ in self)  # stops at the first evictable expert


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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
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
    ) -> None:
        if n_slots < 1:
            raise ValueError("the fast tier needs at least one expert slot")
        self.n_slots = n_slots
        # [n_slots, 3*I*H]; `slots` given: an existing buffer serves as the pool (zero-copy, see adopt).
        self.slots = slots if slots is not None else torch.empty((n_slots, numel), dtype=dtype, device=device)
        self.eviction = eviction
        self.stats = stats
        self.protect_ticks = protect_ticks  # how many MoE layer runs a prefetched expert is protected for
        self._slot_of: dict[int, int] = {}
        self._state: dict[int, SlotState] = {}
        self._pins: dict[int, int] = {}
        self._protected: dict[int, int] = {}  # key -> tick at which its protection expires
        self._clock = 0  # advanced once per MoE layer run (see tick)
        self._free: list[int] = list(range(n_slots - 1, -1, -1))
        self.lock = threading.RLock()
        # Every expert of the model resident in a slot of its own, for good: the zero-copy pool
        # (adopt), or a fast tier as big as the model once filled (mark_complete). Nothing can
        # miss, load or be evicted any more, which lets a decode step skip the bookkeeping that
        # only matters for those (MoeExecutor's resident lane).
        self.complete = False

    @property
    def slot_bytes(self) -> int:
        return self.slots.shape[1] * self.slots.element_size()

    # -- queries ---------------------------------------------------------------
    def is_resident(self, key: int) -> bool:
        return self._state.get(key) is SlotState.RESIDENT

    def state(self, key: int) -> SlotState | None:
        return self._state.get(key)

    def slot_index(self, key: int) -> int:
        return self._slot_of[key]

    def weights(self, key: int) -> torch.Tensor:
        """The flat buffer of a resident (or just-loaded) expert."""
        return self.slots[self._slot_of[key]]

    def pinned_count(self) -> int:
        with self.lock:
            return len(self._pins)

    def has_room(self) -> bool:
        """A demand load could get a slot now (free, or an unpinned resident to evict)."""
        with self.lock:
            return bool(self._free or self._evictable(protected=False) or self._evictable(protected=True))

    def is_protected(self, key: int) -> bool:
        return key in self._protected

    def has_free_slot(self) -> bool:
        return bool(self._free)

    def next_victim(self) -> int | None:
        """The expert a prefetch would evict if no slot were free, or None when nothing can go.
        Callers hold `lock` when they act on the answer."""
        with self.lock:
            return self.eviction.victim(self._evictable(protected=False))

    def free_or_evictable(self) -> int:
        """Slots a layer could take now without waiting: free ones plus unpinned residents."""
        with self.lock:
            return len(self._free) + sum(1 for k, s in self._state.items() if s is SlotState.RESIDENT and k not in self._pins)

    # -- pinning ---------------------------------------------------------------
    def lease(self) -> ExpertLease:
        return ExpertLease(self)

    def pin(self, key: int) -> None:
        with self.lock:
            self._pins[key] = self._pins.get(key, 0) + 1

    def pin_all(self, keys: list[int]) -> None:
        with self.lock:
            pins = self._pins
            for key in keys:
                pins[key] = pins.get(key, 0) + 1

    def unpin(self, key: int) -> None:
        self.unpin_all({key: 1})

    def unpin_all(self, counts: dict[int, int]) -> None:
        """Drop `counts[key]` pins of each key, under one lock acquisition."""
        with self.lock:
            pins = self._pins
            for key, n in counts.items():
                left = pins.get(key, 0) - n  # an aborted load already dropped its pins
                if left > 0:
                    pins[key] = left
                else:
                    pins.pop(key, None)

    def touch(self, key: int) -> None:
        """A plan uses this resident expert: tell the eviction policy; a prefetch pays off."""
        self.touch_all([key])

    def touch_all(self, keys: list[int]) -> None:
        """touch() of each key in order, under one lock acquisition."""
        with self.lock:
            used = 0
            for key in keys:
                self.eviction.on_access(key)
                if self._protected.pop(key, None) is not None:
                    used += 1
            if used:
                self.stats.add(prefetch_used=used)

    def refresh(self, keys: list[int]) -> None:
        """A predictor expects these residents to be used soon: count it as a use for the eviction
        policy's ranking, so the prefetches made for the same layer do not evict them first."""
        with self.lock:
            for key in keys:
                if self._state.get(key) is SlotState.RESIDENT:
                    self.eviction.on_access(key)

    # -- protection of prefetched experts -----------------------------------------
    def protect(self, key: int) -> None:
        """Shield a prefetched expert from eviction until it is used or `protect_ticks` pass."""
        with self.lock:
            self._protected[key] = self._clock + self.protect_ticks

    def begin_layer(self, layer: int) -> None:
        """An MoE layer starts planning: the eviction policy learns where the forward is."""
        with self.lock:
            self.eviction.on_layer(layer)

    def tick(self) -> None:
        """One MoE layer ran: expire protections that were never used (wasted prefetches)."""
        with self.lock:
            self._clock += 1
            expired = [k for k, t in self._protected.items() if t <= self._clock]
            for k in expired:
                del self._protected[k]
            if expired:
                self.stats.add(prefetch_wasted=len(expired))

    def adopt(self, rows: dict[int, int]) -> None:
        """Zero-copy: every key is resident in row rows[key] of the pool, which is the slow tier's
        own buffer (both tiers host memory, cache 1.0): nothing is ever copied or evicted."""
        with self.lock:
            assert not self._state and len(rows) == self.n_slots, "adopt() takes a fresh store covering every slot"
            for key, row in rows.items():
                self._slot_of[key] = row
                self._state[key] = SlotState.RESIDENT
                self.eviction.on_insert(key)
            self._free = []
            self.complete = True

    def mark_complete(self, keys: int) -> bool:
        """Set `complete` where this store has a slot for each of the model's `keys` experts and
        every slot holds a resident one (a fast tier as big as the model, filled). Returns it."""
        with self.lock:
            resident = sum(s is SlotState.RESIDENT for s in self._state.values())
            self.complete = self.n_slots >= keys and resident == keys
            return self.complete

    # -- slot lifecycle (called by the transfer engine) -------------------------
    def reserve(self, key: int, may_evict_protected: bool = True) -> int | None:
        """Claim a slot for `key` (state LOADING, pinned). Evicts an unpinned resident if needed:
        unprotected ones first; protected ones only when `may_evict_protected` (demand loads).

        Returns the slot index, or None if nothing can be evicted.
        """
        with self.lock:
            assert key not in self._state, f"expert key {key} already has a slot"
            if not self._free:
                victim = self.eviction.victim(self._evictable(protected=False))
                if victim is None and may_evict_protected:
                    victim = self.eviction.victim(self._evictable(protected=True))
                if victim is None:
                    return None
                self._drop(victim)
                self.stats.record_eviction()
            slot = self._free.pop()
            self._slot_of[key] = slot
            self._state[key] = SlotState.LOADING
            self._pins[key] = self._pins.get(key, 0) + 1
            # The eviction policy learns of the expert when it is requested, on the requesting
            # thread, not when a transfer thread lands it: its ranking then depends on the order
            # of requests only, never on transfer timing (deterministic eval relies on this).
            self.eviction.on_insert(key)
            return slot

    def commit(self, key: int) -> None:
        """A load finished: the expert is resident (still pinned by its loader until released)."""
        with self.lock:
            self._state[key] = SlotState.RESIDENT

    def abort(self, key: int) -> None:
        """A load was cancelled or failed: give the slot back (and every pin on it)."""
        with self.lock:
            if self._state.get(key) is SlotState.LOADING:
                self._pins.pop(key, None)
                self._protected.pop(key, None)
                self._free.append(self._slot_of.pop(key))
                del self._state[key]
                self.eviction.forget(key)

    def _evictable(self, protected: bool) -> EvictableView:
        return EvictableView(self, protected)

    def _drop(self, key: int) -> None:
        self._free.append(self._slot_of.pop(key))
        del self._state[key]
        if self._protected.pop(key, None) is not None:
            self.stats.add(prefetch_wasted=1)  # evicted before anything used it
        self.eviction.on_remove(key)
