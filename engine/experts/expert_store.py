"""The fast tier: a fixed pool of expert slots and the residency map.

Each slot is one contiguous row of a preallocated [n_slots, numel] tensor on the compute
device, so loading an expert is one copy and nothing is allocated on the hot path.

Keys are ints (layer * num_experts + expert) to keep the per-layer bookkeeping cheap.
A key is in one of two states: LOADING (slot reserved, copy in flight) or RESIDENT.
Pinned keys (in use by the current layer, or being loaded) are never evicted; the
eviction *choice* among unpinned residents is delegated to a policy object.
"""
from __future__ import annotations

import threading
from enum import Enum

import torch

from engine.stats import EngineStats
from policies.base import EvictionPolicy


class SlotState(Enum):
    LOADING = "loading"
    RESIDENT = "resident"


class ExpertStore:
    def __init__(
        self,
        n_slots: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        eviction: EvictionPolicy,
        stats: EngineStats,
    ) -> None:
        if n_slots < 1:
            raise ValueError("the fast tier needs at least one expert slot")
        self.n_slots = n_slots
        self.slots = torch.empty((n_slots, numel), dtype=dtype, device=device)  # [n_slots, 3*I*H]
        self.eviction = eviction
        self.stats = stats
        self._slot_of: dict[int, int] = {}
        self._state: dict[int, SlotState] = {}
        self._pins: dict[int, int] = {}
        self._free: list[int] = list(range(n_slots - 1, -1, -1))
        self.lock = threading.RLock()

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

    # -- pinning ---------------------------------------------------------------
    def pin(self, key: int) -> None:
        with self.lock:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: int) -> None:
        with self.lock:
            n = self._pins.get(key, 0) - 1  # an aborted load already dropped its pins
            if n > 0:
                self._pins[key] = n
            else:
                self._pins.pop(key, None)

    def touch(self, key: int) -> None:
        with self.lock:
            self.eviction.on_access(key)

    # -- slot lifecycle (called by the transfer engine) -------------------------
    def reserve(self, key: int) -> int | None:
        """Claim a slot for `key` (state LOADING, pinned). Evicts an unpinned resident if needed.

        Returns the slot index, or None if every slot is pinned.
        """
        with self.lock:
            assert key not in self._state, f"expert key {key} already has a slot"
            if not self._free:
                victim = self.eviction.victim(self._evictable())
                if victim is None:
                    return None
                self._drop(victim)
                self.stats.record_eviction()
            slot = self._free.pop()
            self._slot_of[key] = slot
            self._state[key] = SlotState.LOADING
            self._pins[key] = self._pins.get(key, 0) + 1
            return slot

    def commit(self, key: int) -> None:
        """A load finished: the expert is resident (still pinned by its loader until released)."""
        with self.lock:
            self._state[key] = SlotState.RESIDENT
            self.eviction.on_insert(key)

    def abort(self, key: int) -> None:
        """A load was cancelled or failed: give the slot back."""
        with self.lock:
            if self._state.get(key) is SlotState.LOADING:
                self._pins.pop(key, None)
                self._free.append(self._slot_of.pop(key))
                del self._state[key]

    def _evictable(self) -> list[int]:
        return [k for k, s in self._state.items() if s is SlotState.RESIDENT and k not in self._pins]

    def _drop(self, key: int) -> None:
        self._free.append(self._slot_of.pop(key))
        del self._state[key]
        self.eviction.on_remove(key)
