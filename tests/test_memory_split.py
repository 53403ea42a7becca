"""The KV/expert split's moving parts (engine/memory/split.py): the block accounting grows and shrinks
(engine/core/kv_blocks.py `resize`), the fast tier lends slots through its eviction path and takes them
back (engine/experts/tiers/residency.py `withdraw` / `restore`), freed pages go back to the OS
(engine/huge_pages.py `release_pages`), and MemorySplit keeps the two sides in step."""

from __future__ import annotations

import torch

from engine.core.kv_blocks import KVBlocks
from engine.core.kv_demand import KvDemand
from engine.core.messages import GenerateRequest
from engine.core.step_types import SeqState
from engine.experts.tiers.residency import LANDED, Residency
from engine.huge_pages import PAGE, release_pages
from engine.memory.split import MemorySplit, split_line
from engine.stats import EngineStats
from engine.worker.sampling import SamplingParams
from policies.lru import LRUEviction
from policies.memory_split import MemorySplitPolicy


def test_blocks_grow_and_shrink_above_the_highest_held_block() -> None:
    kv = KVBlocks(4, 16)
    assert kv.allocate("a", 32)  # blocks 0, 1
    assert kv.resize(8) == 8 and kv.available() == 6
    assert kv.allocate("b", 80)  # the lower free ids first: 2, 3, then the new 4, 5, 6
    assert kv.table("b") == [2, 3, 4, 5, 6]
    assert kv.resize(4) == 7  # block 6 is held: the pool stops above it
    assert kv.counts().total == 7 and kv.available() == 0
    kv.free("b")
    assert kv.resize(4) == 4 and kv.available() == 2
    assert kv.allocate("c", 32) and kv.table("c") == [2, 3]
    assert not kv.allocate("d", 16)


def test_shrinking_evicts_the_cached_prefixes_above() -> None:
    kv = KVBlocks(2, 16)
    kv.resize(4)
    ids = list(range(100, 164))
    assert kv.allocate("a", 64)
    kv.commit("a", ids, 64)
    kv.free("a")  # four cached blocks
    assert kv.counts().cached == 4
    assert kv.resize(2) == 2 and kv.counts().cached == 2
    assert kv.match("b", ids) == 32  # the first two blocks are still shared


def _residency(n: int) -> Residency:
    res = Residency(n, LRUEviction())
    for key in range(n):
        res.reserve(key, pin=False)
        res.land(key, LANDED)
    return res


def test_slots_are_lent_from_the_least_recently_used_end_and_come_back_free() -> None:
    res = _residency(6)
    res.touch_all([0, 1, 2, 3])  # 4 and 5 are the least recently used
    res.pin_all([4])  # in use: it stays
    taken = res.withdraw(2)
    assert len(taken) == 2 and res.capacity == 4 and res.evictions == 2
    assert not res.is_resident(5) and not res.is_resident(0) and res.is_resident(4)
    assert res.ghosts == {5, 0}
    res.reserve(5, pin=False)  # a lent-away expert is needed again: counted (it evicts 1, the LRU)
    assert res.ghost_loads == 1 and res.evictions == 3
    assert res.restore(5) == taken and res.capacity == 6 and not res.ghosts
    assert sorted(res.free) == sorted(taken)  # both lent slots are back, free for the next loads


def test_withdraw_stops_at_what_is_pinned() -> None:
    res = _residency(3)
    res.pin_all([0, 1, 2])
    assert res.withdraw(2) == [] and res.capacity == 3


def test_released_pages_read_as_zeros_and_neighbours_keep_their_values() -> None:
    buf = torch.ones(8 * PAGE // 4, dtype=torch.float32)
    freed = release_pages(buf[PAGE // 4 : 5 * PAGE // 4 + 3])
    lo = (
        -(-(buf.data_ptr() + PAGE) // PAGE) * PAGE - buf.data_ptr()
    )  # first whole page inside, in bytes
    assert freed >= 3 * PAGE
    flat = buf.view(torch.uint8)
    assert int(flat[lo : lo + freed].sum()) == 0  # dropped: fresh zero pages
    assert bool((buf[: PAGE // 4] == 1).all())  # before the range: untouched
    assert bool((buf[5 * PAGE // 4 + 3 :] == 1).all())  # after it: untouched


class _Store:
    """The fast tier as MemorySplit sees it: a Residency, slot bytes, withdraw/restore."""

    def __init__(self, n: int, slot_bytes: int) -> None:
        self.res, self.slot_bytes = _residency(n), slot_bytes

    @property
    def capacity(self) -> int:
        return self.res.capacity

    def withdraw(self, n: int) -> int:
        return len(self.res.withdraw(n))

    def restore(self, n: int) -> int:
        return len(self.res.restore(n))


def test_the_split_lends_under_load_and_takes_back_when_idle() -> None:
    stats = EngineStats(num_layers=1)
    store = _Store(20, slot_bytes=3 * 4096)  # a slot holds 3 blocks
    split = MemorySplit(
        MemorySplitPolicy(max_share=0.5),
        store,
        base_blocks=10,
        block_bytes=4096,
        floor_slots=4,
        stats=stats,
    )
    kv = KVBlocks(10, 16)
    assert split.max_blocks() == 10 + 30  # 10 slots movable
    budget = 10 * 4096 + 20 * 3 * 4096
    split.rebalance(kv, demand_blocks=17, idle=False)  # 7 over: 3 slots (9 blocks)
    assert (kv.total, store.capacity, split.lent, split.moves) == (19, 17, 3, 1)
    assert stats.memory_split == (19 * 4096, 17 * 3 * 4096) and sum(stats.memory_split) == budget
    split.rebalance(kv, demand_blocks=500, idle=False)
    assert (kv.total, store.capacity) == (40, 10)  # the cap
    assert kv.allocate("a", 39 * 16)  # a request holds the top block
    split.rebalance(kv, demand_blocks=0, idle=True)
    assert (kv.total, store.capacity) == (40, 10)  # nothing could go back yet
    kv.free("a")
    split.rebalance(kv, demand_blocks=0, idle=True)
    assert (kv.total, store.capacity, split.lent) == (10, 20, 0)
    assert stats.memory_split_moves == 3 and sum(stats.memory_split) == budget


def test_a_fixed_split_moves_nothing() -> None:
    store = _Store(8, slot_bytes=4096)
    why = "every expert is the RAM tier's buffer (zero-copy): the fast tier cannot shrink"
    split = MemorySplit(MemorySplitPolicy(), store, 10, 4096, 2, fixed=why)
    kv = KVBlocks(10, 16)
    split.rebalance(kv, demand_blocks=100, idle=False)
    assert (kv.total, store.capacity, split.max_blocks()) == (10, 8, 10)
    assert why in split.line()


def test_the_line_states_the_movable_range() -> None:
    line = split_line(10 * 4096, 20, 3 * 4096, 10, 4096, 0.5)
    assert (
        "up to 10 expert slots" in line and "30 blocks" in line and "--kv-borrow-share 0.5" in line
    )


def _waiting(rid: str, ids: list[int]) -> SeqState:
    return SeqState(GenerateRequest(rid, ids, SamplingParams(max_tokens=4)), None)  # type: ignore[arg-type]


def test_demand_counts_a_registered_prefix_once() -> None:
    kv = KVBlocks(64, 16)
    prefix = list(range(1, 65))  # 4 blocks
    assert kv.allocate("a", 64)
    demand = KvDemand()
    waiting = [_waiting(r, prefix + [500 + i, 600 + i]) for i, r in enumerate("bc")]
    # Not registered yet (a's prefill is under way): each waiting request counts its 5 blocks.
    assert demand(kv, 1, waiting, max_running=8) == 4 + 2 * 5
    kv.commit("a", prefix, 64)
    assert kv.peek(prefix + [500]) == 64
    # Registered: each waiting request wants only its own fifth block.
    assert demand(kv, 1, waiting, max_running=8) == 4 + 2 * 1
    # Only those that could start count (--max-running): one more here.
    assert demand(kv, 1, waiting, max_running=2) == 4 + 1
    kv.free("a")
    kv.resize(2)  # the cached prefix above block 2 is evicted: the lookup is made again
    assert kv.peek(prefix + [500]) == 32
    assert demand(kv, 0, waiting, max_running=8) == 0 + 2 * 3


def test_metrics_show_the_split() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.metrics import EngineStatsCollector

    stats = EngineStats(num_layers=1)
    stats.set_memory_split(19 * 4096, 17 * 12288, 1)
    collector = EngineStatsCollector()
    collector.snapshot = stats.snapshot()
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'moe_offload_memory_split_bytes{part="kv"} 77824.0' in text
    assert 'moe_offload_memory_split_bytes{part="experts"} 208896.0' in text
    assert "moe_offload_memory_split_moves_total 1.0" in text


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_lent_slots_give_their_memory_back_to_the_os() -> None:
    from engine.experts.tiers.expert_store import ExpertStore

    store = ExpertStore(
        16, 1 << 18, torch.float32, torch.device("cpu"), LRUEviction(), EngineStats(1)
    )
    for key in range(16):  # every slot written: 1 MiB each, resident
        slot = store.reserve(key)
        assert slot is not None
        store.slots[slot].fill_(1.0)
        store.commit(key)
        store.unpin(key)
    before = _rss()
    assert store.withdraw(8) == 8 and store.capacity == 8
    assert (
        before - _rss() >= 7 << 20
    )  # 8 MiB of slots, less what else the process touched meanwhile
    assert store.restore(8) == 8 and store.capacity == 16


def test_cached_prefixes_move_below_a_shrink() -> None:
    kv = KVBlocks(2, 16)
    kv.resize(6)
    a, b = list(range(100, 132)), list(range(200, 232))
    assert kv.allocate("x", 32)  # blocks 0, 1: held
    assert kv.allocate("a", 32) and kv.allocate("b", 32)  # 2, 3 and 4, 5
    kv.commit("a", a, 32)
    kv.commit("b", b, 32)
    kv.free("a")
    kv.free("b")  # b is the most recently used
    kv.free("x")  # 0, 1 free again (never registered)
    pairs = kv.relocate(2)
    assert sorted(src for src, _ in pairs) == [4, 5] and sorted(dst for _, dst in pairs) == [0, 1]
    assert kv.resize(2) == 2 and kv.counts().cached == 2
    assert kv.match("r", b + [1]) == 32 and sorted(kv.table("r")) == [
        0,
        1,
    ]  # b's prefix, now in 0 and 1
    assert kv.match("s", a + [1]) == 0  # a's went: no room below


class _Pool:
    def __init__(self) -> None:
        self.copied: list[tuple[int, int]] = []
        self.released: list[tuple[int, int]] = []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.copied += pairs

    def release(self, first: int, last: int) -> int:
        self.released.append((first, last))
        return 0


def test_giving_back_copies_the_prefixes_it_keeps_and_releases_the_rest() -> None:
    store = _Store(20, slot_bytes=4096)
    split = MemorySplit(MemorySplitPolicy(max_share=0.5), store, 4, 4096, 2)
    split.pool = pool = _Pool()
    kv = KVBlocks(4, 16)
    split.rebalance(kv, demand_blocks=8, idle=False)
    assert kv.total == 8
    ids = list(range(100, 164))
    assert kv.allocate("filler", 64) and kv.allocate("a", 64)  # a in 4..7
    kv.commit("a", ids, 64)
    kv.free("a")
    kv.free("filler")
    split.rebalance(kv, demand_blocks=0, idle=True)
    assert kv.total == 4 and sorted(d for _, d in pool.copied) == [0, 1, 2, 3]
    assert pool.released == [(4, 8)] and kv.match("r", ids + [1]) == 64
