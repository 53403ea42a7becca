"""The tensor-free residency core (engine/experts/tiers/residency.py) that ExpertStore and the simulator
share: which expert a reservation evicts, what pins and protection keep, what is counted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Hashable

from engine.experts.tiers.residency import INF, LANDED, Residency
from policies.base import EvictionPolicy
from policies.lru import LRUEviction


class Recording(LRUEviction):
    """LRU that records the hooks the residency calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Hashable]] = []

    def on_insert(self, key: Hashable) -> None:
        self.calls.append(("insert", key))
        super().on_insert(key)

    def on_remove(self, key: Hashable) -> None:
        self.calls.append(("remove", key))
        super().on_remove(key)

    def forget(self, key: Hashable) -> None:
        self.calls.append(("forget", key))
        super().forget(key)


def _full(ev: EvictionPolicy, n: int = 3) -> Residency:
    res = Residency(n, ev, protect_ticks=2)
    for key in range(n):
        assert res.reserve(key) == key  # slot 0 first
        res.land(key)
        res.unpin_all({key: 1})  # the loader's pin
    return res


def test_reserve_evicts_the_policys_victim_among_landed_unpinned_experts() -> None:
    ev = Recording()
    res = _full(ev)
    res.pin_all([0])  # in use: never a victim
    assert res.reserve(10) == 1 and 1 not in res.ready and res.evictions == 1  # LRU among {1, 2}
    assert res.ready[10] == INF and res.pins[10] == 1  # loading, pinned by its loader
    assert res.reserve(11) == 2  # 10 is loading (not resident), 0 pinned: 2 goes
    assert res.reserve(12) is None  # 0 pinned, 10 and 11 still loading: nothing can go
    assert ("remove", 1) in ev.calls and ("remove", 2) in ev.calls


def test_protected_prefetches_go_last_and_expire_as_wasted() -> None:
    wasted: list[int] = []
    res = Residency(2, LRUEviction(), protect_ticks=2, on_waste=wasted.append)
    for key in (0, 1):
        res.reserve(key, pin=False)
        res.land(key, 0.0)
    res.protect(0)  # the least recently inserted, but protected
    assert res.reserve(5, may_evict_protected=False, pin=False) == 1  # the unprotected one goes
    assert (
        res.reserve(6, may_evict_protected=False, pin=False) is None
    )  # only a protected one is left (5 is loading)
    assert res.tick() == 0 and res.tick() == 1  # protect_ticks runs later its protection expires
    assert wasted == [1] and res.wasted == 1 and not res.protected


def test_a_used_prefetch_counts_once_and_is_no_longer_protected() -> None:
    res = _full(LRUEviction())
    res.protect(2)
    assert res.touch_all([1, 2]) == 1 and res.touch_all([2]) == 0
    assert res.tick() == 0 and res.wasted == 0


def test_abort_forgets_a_load_while_drop_evicts() -> None:
    ev = Recording()
    res = _full(ev, n=2)
    res.drop(0)
    assert res.reserve(7) == 0
    res.abort(7)  # never resident: the policy forgets it, its slot and pins are free
    i = ev.calls.index(("insert", 7))
    assert ev.calls[i - 1] == ("remove", 0) and ev.calls[i + 1] == (
        "forget",
        7,
    )  # (LRU's forget then removes it)
    assert 7 not in res.ready and 7 not in res.pins and res.free == [0]
    res.abort(1)  # a resident expert is not aborted
    assert res.is_resident(1) and res.ready[1] == LANDED


def test_the_simulated_clock_decides_residency() -> None:
    res = Residency(2, LRUEviction())
    res.reserve(0, pin=False)
    res.land(0, 5.0)  # its transfer lands at t=5
    assert not res.is_resident(0, now=4.0) and res.is_resident(0, now=5.0)
    res.reserve(1, pin=False)
    res.land(1, 1.0)
    assert res.reserve(2, now=4.0, pin=False) == 1  # only 1 has landed by t=4
    assert res.free_or_evictable(now=6.0) == 1 and res.evictable_set(now=6.0) == {
        0
    }  # 2 is still loading


def test_the_replays_tensor_free_modules_import_no_torch() -> None:
    code = (
        "import sys, engine.experts.tiers.residency, engine.experts.compute.cpu_split, engine.offline.simulator; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
