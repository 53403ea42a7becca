"""Belady's MIN (engine/offline/belady.py) is the true minimum: checked against exhaustive search."""

from __future__ import annotations

import functools
import random

import pytest

from engine.offline.belady import flatten, lru_loads, min_loads


def brute_force_min(seq: tuple[int, ...], capacity: int, resident: frozenset[int]) -> int:
    """Fewest loads over every possible eviction choice (exponential: tiny inputs only)."""

    @functools.cache
    def best(i: int, cached: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        key = seq[i]
        if key in cached:
            return best(i + 1, cached)
        if len(cached) < capacity:
            return 1 + best(i + 1, cached | {key})
        return 1 + min(best(i + 1, (cached - {v}) | {key}) for v in cached)

    return best(0, resident)


@pytest.mark.parametrize("seed", range(40))
def test_min_loads_equals_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    universe = rng.randint(3, 7)
    capacity = rng.randint(1, universe - 1)
    seq = tuple(rng.randrange(universe) for _ in range(rng.randint(5, 14)))
    resident = frozenset(rng.sample(range(universe), rng.randint(0, capacity)))
    assert min_loads(seq, capacity, resident) == brute_force_min(seq, capacity, resident)
    assert min_loads(seq, capacity, resident) <= lru_loads(seq, capacity, sorted(resident))


def test_cyclic_pattern_lru_misses_everything_min_does_not() -> None:
    seq = [1, 2, 3, 4] * 5
    assert lru_loads(seq, 3) == 20  # LRU's worst case: always evicts the next one needed
    assert (
        min_loads(seq, 3) == 9
    )  # 4 cold loads, then about one per 3 accesses: MIN keeps 2 of its 3 slots useful


def test_flatten_dedups_and_orders_each_call() -> None:
    assert flatten([[5, 3, 5], [2], []]) == [3, 5, 2]


def test_min_loads_rejects_empty_tier() -> None:
    with pytest.raises(ValueError, match="capacity"):
        min_loads([1], 0)
