"""Reuse-distance eviction (policies/reuse_distance.py): what it evicts, and what it saves."""

from __future__ import annotations

import random

import pytest

from engine.offline.belady import flatten, min_loads
from policies.base import EvictionPolicy
from policies.lru import LRUEviction
from policies.registry import make_policies
from policies.reuse_distance import ReuseDistanceEviction

E = 16  # experts per layer in these synthetic runs


def drive(policy: EvictionPolicy, steps: list[list[list[int]]], capacity: int) -> int:
    """Run layer-ordered accesses through a tier of `capacity` slots as the store does (plan a
    layer, touch its residents, load its misses evicting the policy's victim); returns loads."""
    resident: set[int] = set()
    loads = 0
    for step in steps:
        for layer, experts in enumerate(step):
            policy.on_layer(layer)
            keys = [layer * E + e for e in sorted(set(experts))]
            for key in keys:
                if key in resident:
                    policy.on_access(key)
            for key in keys:
                if key in resident:
                    continue
                if len(resident) >= capacity:
                    victim = policy.victim(resident - set(keys))  # this layer's experts are pinned
                    assert victim is not None
                    resident.discard(victim)
                    policy.on_remove(victim)
                resident.add(key)
                policy.on_insert(key)
                loads += 1
    return loads


def reuse(layers: int) -> ReuseDistanceEviction:
    policy = ReuseDistanceEviction()
    policy.bind(list(range(layers)), E)
    return policy


def test_sticky_experts_over_a_layer_cycle_bigger_than_the_tier() -> None:
    # 3 layers, each with 5 sticky experts (used 90 % of forwards) and 3 random one-offs: about
    # 24 experts a forward against 16 slots. LRU evicts by age and loses the sticky ones.
    rng = random.Random(0)
    steps = [
        [[e for e in range(5) if rng.random() < 0.9] + rng.sample(range(5, E), 3) for _ in range(3)]
        for _ in range(60)
    ]
    lru = drive(LRUEviction(), steps, capacity=16)
    ours = drive(reuse(3), steps, capacity=16)
    bound = min_loads(
        flatten(
            [[layer * E + e for e in exps] for step in steps for layer, exps in enumerate(step)]
        ),
        16,
    )
    assert bound <= ours < 0.7 * lru


def test_a_sticky_expert_outlives_a_one_off_used_at_the_same_time() -> None:
    policy = reuse(2)
    steps = [[[1], [2]] for _ in range(5)] + [
        [[1, 3], [2]]
    ]  # expert 1 in every forward, expert 3 in the last
    for step in steps:
        for layer, experts in enumerate(step):
            policy.on_layer(layer)
            for e in experts:
                policy.on_insert(layer * E + e)
    policy.on_layer(0)
    assert policy.victim({1, 3}) == 3


def test_the_layer_that_runs_next_keeps_its_experts() -> None:
    policy = reuse(4)
    for layer in range(4):  # one use each, same p
        policy.on_layer(layer)
        policy.on_insert(layer * E + 5)
    policy.on_layer(1)  # layer 1 runs: layer 2 is next, layer 1 comes back after a whole forward
    assert policy.victim({0 * E + 5, 1 * E + 5, 2 * E + 5}) == 1 * E + 5
    assert policy.victim({2 * E + 5, 3 * E + 5}) == 3 * E + 5


@pytest.mark.parametrize("seed", range(10))
def test_heap_victim_is_the_farthest_predicted_next_use(seed: int) -> None:
    rng = random.Random(seed)
    layers = 3
    policy = reuse(layers)
    resident: set[int] = set()
    for _ in range(300):
        layer = rng.randrange(layers)
        policy.on_layer(layer)
        for e in rng.sample(range(E), 4):
            key = layer * E + e
            if key in resident:
                policy.on_access(key)
            else:
                resident.add(key)
                policy.on_insert(key)
        if len(resident) > 20:
            cand = set(rng.sample(sorted(resident), 12))
            victim = policy.victim(cand)
            best = max(policy.predicted_next_use(k) for k in cand)
            assert policy.predicted_next_use(victim) == pytest.approx(best)
            resident.discard(victim)
            policy.on_remove(victim)


def test_heaps_stay_bounded_when_nothing_is_evicted() -> None:
    policy = reuse(2)
    for key in range(2 * E):
        policy.on_insert(key)
    for _ in range(2000):  # everything resident (cache 1.0): only uses, never a victim
        for layer in range(2):
            policy.on_layer(layer)
            for e in range(4):
                policy.on_access(layer * E + e)
    assert sum(len(h) for h in policy._heaps.values()) <= 2 * (2 * E + 1024) + 8
    assert policy.victim(set(range(2 * E))) is not None


def test_reuse_is_a_named_eviction_policy() -> None:
    assert isinstance(make_policies("fetch-all", eviction="reuse").eviction, ReuseDistanceEviction)
    with pytest.raises(ValueError, match="rate"):
        ReuseDistanceEviction(rate=1.0)
