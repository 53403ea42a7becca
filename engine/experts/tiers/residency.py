"""The fast tier's residency, on ids and numbers only: which experts hold a slot, which are pinned,
which prefetched ones are protected, and what the eviction policy is told. Tensor-free.

Two users drive this one copy of the rules:
- engine/experts/tiers/expert_store.py wraps it with the slot tensor and a lock (the engine);
- engine/offline/simulator.py replays router traces against it on a simulated clock.

Keys are ints (layer * num_experts + expert). `ready[key]` says when a reserved expert is resident:
INF while its load is in flight or queued, LANDED once the engine committed it, or the simulated
time at which its transfer lands. An expert is resident at `now` when ready[key] <= now; the engine
asks at now=0.0, so for it "resident" means committed.

Three things keep a resident expert from being evicted:
- a pin: it is in use by the current layer, or being loaded;
- protection: it was prefetched and has not been used yet, until it is used or `protect_ticks`
  MoE layer runs (ticks) pass;
- the eviction policy's ranking among everything else.

Slots can be lent out (withdraw/restore: the KV/expert split, engine/memory/split.py): a lent slot is in
no list, so the tier's capacity is n_slots less the lent ones; the experts evicted to lend it are ghosts,
and loading one again is counted (what the lent slots cost).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from typing import cast

from policies.base import EvictionPolicy

INF = math.inf
LANDED = -math.inf  # resident at any time: what the engine's commit records


class EvictableView(AbstractSet[int]):
    """The residents an eviction may take at `now` (resident, unpinned, protected or not as asked),
    as a live view: a policy that walks its own order (LRU, reuse distance) asks `key in view` for
    a few keys instead of anyone listing every resident for each eviction."""

    def __init__(self, res: Residency, now: float, protected: bool) -> None:
        self._ready, self._pins, self._protected = res.ready, res.pins, res.protected
        self._now, self._want = now, protected

    def __contains__(self, key: object) -> bool:
        t = self._ready.get(key)  # type: ignore[call-overload]
        return (
            t is not None
            and t <= self._now
            and key not in self._pins
            and (key in self._protected) == self._want
        )

    def __iter__(self) -> Iterator[int]:
        return (k for k in list(self._ready) if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        return any(True for _ in self)  # stops at the first evictable expert


class Residency:
    def __init__(
        self,
        n_slots: int,
        eviction: EvictionPolicy,
        protect_ticks: int = 16,
        on_evict: Callable[[], None] | None = None,
        on_waste: Callable[[int], None] | None = None,
    ) -> None:
        if n_slots < 1:
            raise ValueError("the fast tier needs at least one expert slot")
        self.n_slots, self.eviction, self.protect_ticks = n_slots, eviction, protect_ticks
        self.ready: dict[int, float] = {}  # key -> when it is resident (see the module docstring)
        self.slot_of: dict[int, int] = {}
        self.pins: dict[int, int] = {}  # key -> pin count
        self.protected: dict[int, int] = {}  # key -> tick at which its protection expires
        self.clock = 0  # MoE layer runs so far (see tick)
        self.free: list[int] = list(range(n_slots - 1, -1, -1))  # slot 0 is taken first
        # Counters, and what to tell as they move: evictions, and prefetches that expired or were
        # evicted before anything used them (wasted).
        self.evictions = self.wasted = 0
        self._on_evict, self._on_waste = on_evict, on_waste
        # Slots lent to the KV pool (withdraw/restore: engine/memory/split.py), out of use; the experts they
        # held (ghosts) and how many of those were loaded again since (what the lent slots cost).
        self.withdrawn: list[int] = []
        self.ghosts: set[int] = set()
        self.ghost_loads = 0

    # -- queries -------------------------------------------------------------------------------
    def is_resident(self, key: int, now: float = 0.0) -> bool:
        return self.ready.get(key, INF) <= now

    @property
    def capacity(self) -> int:
        """Slots in use or free to use: the fast tier's size less what it lent."""
        return self.n_slots - len(self.withdrawn)

    def evictable(self, now: float = 0.0, protected: bool = False) -> EvictableView:
        return EvictableView(self, now, protected)

    def evictable_set(self, now: float = 0.0) -> set[int]:
        """The unprotected evictable experts as a set: for a step that reserves many slots while many
        residents are pinned, one set per layer beats asking the live view key by key."""
        return (
            {k for k, t in self.ready.items() if t <= now}
            - self.pins.keys()
            - self.protected.keys()
        )

    def free_or_evictable(self, now: float = 0.0) -> int:
        """Slots a layer could take now without waiting: free ones plus unpinned residents."""
        return len(self.free) + sum(
            1 for k, t in self.ready.items() if t <= now and k not in self.pins
        )

    # -- pins and uses ---------------------------------------------------------------------------
    def pin_all(self, keys: Iterable[int]) -> None:
        pins = self.pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1

    def unpin_all(self, counts: dict[int, int]) -> None:
        """Drop `counts[key]` pins of each key (an aborted load already dropped its pins)."""
        pins = self.pins
        for key, n in counts.items():
            left = pins.get(key, 0) - n
            if left > 0:
                pins[key] = left
            else:
                pins.pop(key, None)

    def pin_only(self, keys: Iterable[int]) -> None:
        """Exactly `keys` pinned once each (the simulator's current layer). A new dict: a view made
        before keeps the pins it was made with."""
        self.pins = dict.fromkeys(keys, 1)

    def touch_all(self, keys: list[int]) -> int:
        """A plan uses these residents, in this order: tell the eviction policy, and end their
        protection. Returns how many were protected prefetches (used prefetches)."""
        on_access = self.eviction.on_access
        for key in keys:
            on_access(key)
        prot = self.protected
        return sum(1 for key in keys if prot.pop(key, None) is not None) if prot else 0

    # -- protection of prefetched experts -----------------------------------------------------
    def protect(self, key: int) -> None:
        """Shield a prefetched expert from eviction until it is used or `protect_ticks` pass."""
        self.protected[key] = self.clock + self.protect_ticks

    def tick(self) -> int:
        """One MoE layer ran: protections that were never used expire. Returns how many (wasted)."""
        self.clock += 1
        if not self.protected:
            return 0
        expired = [k for k, t in self.protected.items() if t <= self.clock]
        for k in expired:
            del self.protected[k]
        if expired:
            self._waste(len(expired))
        return len(expired)

    # -- slot lifecycle --------------------------------------------------------------------------
    def reserve(
        self,
        key: int,
        may_evict_protected: bool = True,
        now: float = 0.0,
        pin: bool = True,
        victim: int | None = None,
        candidates: set[int] | None = None,
    ) -> int | None:
        """Claim a slot for `key` (ready INF; pinned once when `pin`, the loader's pin). Evicts an
        unpinned resident if no slot is free: unprotected ones first; protected ones only when
        `may_evict_protected` (demand loads). `victim`: the policy's victim, where the caller already
        asked for it; `candidates`: an evictable_set the caller keeps across one layer's
        reservations (the victim leaves it). Returns the slot, or None if nothing can be evicted."""
        assert key not in self.ready, f"expert key {key} already has a slot"
        if self.ghosts and key in self.ghosts:
            self.ghosts.discard(key)
            self.ghost_loads += 1
        if not self.free:
            if victim is None:
                victim = cast(
                    "int | None",
                    self.eviction.victim(
                        self.evictable(now, False) if candidates is None else candidates
                    ),
                )
            if candidates is not None:
                candidates.discard(victim)  # None: a no-op
            if victim is None and may_evict_protected:
                victim = cast("int | None", self.eviction.victim(self.evictable(now, True)))
            if victim is None:
                return None
            self._evict(victim)
        slot = self.free.pop()
        self.slot_of[key] = slot
        self.ready[key] = INF
        if pin:
            self.pins[key] = self.pins.get(key, 0) + 1
        # The eviction policy learns of the expert when it is requested, not when it lands: its
        # ranking then depends on the order of requests only, never on transfer timing.
        self.eviction.on_insert(key)
        return slot

    def _evict(self, key: int) -> None:
        self.drop(key)
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict()

    # -- lending slots (the KV/expert split) -----------------------------------------------------
    def withdraw(self, n: int, now: float = 0.0) -> list[int]:
        """Take up to `n` slots out of use, for the KV pool: free ones first, then the eviction policy's
        victims (unprotected first), evicted as any eviction is. Pinned and loading experts stay. Returns
        the slots taken; their experts become ghosts (a later load of one is counted in ghost_loads)."""
        taken: list[int] = []
        while len(taken) < n and self.capacity - len(taken) > 1:
            if not self.free:
                victim = self.eviction.victim(self.evictable(now, False))
                if victim is None:
                    victim = self.eviction.victim(self.evictable(now, True))
                if victim is None:
                    break
                self._evict(cast(int, victim))
                self.ghosts.add(cast(int, victim))
            taken.append(self.free.pop())
        self.withdrawn += taken
        return taken

    def restore(self, n: int) -> list[int]:
        """Put the last `n` lent slots back in use (free: the normal admission refills them). Returns them."""
        back = self.withdrawn[len(self.withdrawn) - min(n, len(self.withdrawn)) :]
        del self.withdrawn[len(self.withdrawn) - len(back) :]
        self.free.extend(back)
        if not self.withdrawn:
            self.ghosts.clear()
        return back

    def land(self, key: int, at: float = LANDED) -> None:
        """The expert is (or will be, at `at`) resident."""
        self.ready[key] = at

    def drop(self, key: int) -> None:
        """Evict `key`: its slot is free again (a protected one was a wasted prefetch)."""
        self.free.append(self.slot_of.pop(key))
        del self.ready[key]
        if self.protected.pop(key, None) is not None:
            self._waste(1)
        self.eviction.on_remove(key)

    def abort(self, key: int) -> None:
        """A load that has not landed was cancelled or failed: give the slot back, with every pin on
        it, and let the eviction policy forget it (never resident: not an eviction)."""
        if self.ready.get(key) == INF:
            self.pins.pop(key, None)
            self.protected.pop(key, None)
            self.free.append(self.slot_of.pop(key))
            del self.ready[key]
            self.eviction.forget(key)

    def adopt(self, rows: dict[int, int]) -> None:
        """Every key resident in slot rows[key], for good (a zero-copy pool covering every slot)."""
        assert not self.ready and len(rows) == self.n_slots, (
            "adopt() takes a fresh residency covering every slot"
        )
        for key, row in rows.items():
            self.slot_of[key] = row
            self.ready[key] = LANDED
            self.eviction.on_insert(key)
        self.free = []

    def _waste(self, n: int) -> None:
        self.wasted += n
        if self._on_waste is not None:
            self._on_waste(n)
