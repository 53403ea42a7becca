"""bench/eviction_replay.py: the executor's order of loads and evictions, replayed on hand-made routing."""

from __future__ import annotations

from collections.abc import Sequence

from bench.eviction_replay import POLICIES, accesses, replay, table
from engine.offline.belady import min_loads
from policies.lru import LRUEviction


def test_lru_replay_counts_the_loads_by_hand() -> None:
    # one layer of 4 experts, one expert a token: A B C A B C with 2 slots thrashes under LRU
    keys = accesses([[[e]] for e in (0, 1, 2, 0, 1, 2)], 4)
    loads, start = replay(keys, 2, LRUEviction(), warm=0, num_experts=4)
    assert (loads, start) == (6, set())
    loads, start = replay(
        keys, 2, LRUEviction(), warm=3, num_experts=4
    )  # after A B C: B and C resident
    assert (loads, start) == (3, {1, 2})
    seq = [k for t in keys[3:] for layer in t for k in layer]
    assert min_loads(seq, 2, start) == 2  # MIN loads A over C (used last), then C again


def test_no_policy_beats_min_from_its_own_start() -> None:
    ids = [[[t % 5, (t * 3) % 7], [t % 2, 4]] for t in range(40)]  # 2 layers of 8 experts
    keys = accesses(ids, 8)
    seq = [k for t in keys[10:] for layer in t for k in layer]
    for make in POLICIES.values():
        loads, start = replay(keys, 6, make(), warm=10, num_experts=8)
        assert loads >= min_loads(seq, 6, start)
    rows = table(keys, 6, 10, 8)
    assert len(rows) == 2 + len(POLICIES) and all(r.count("|") == 5 for r in rows)


def test_policies_are_bound_as_the_store_binds_them() -> None:
    """Reuse distance reads a key's layer as key // num_experts: the replay must bind the trace's
    experts a layer, not the largest key."""
    bound: list[tuple[list[int], int]] = []

    class Spy(LRUEviction):
        def bind(self, moe_layers: Sequence[int], num_experts: int) -> None:
            bound.append((list(moe_layers), num_experts))

    keys = accesses([[[1], [2], [3]] for _ in range(4)], 8)  # 3 layers of 8 experts
    replay(keys, 2, Spy(), warm=0, num_experts=8)
    assert bound == [([0, 1, 2], 8)]
