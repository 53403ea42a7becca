"""The KV/expert split policy (policies/memory_split.py): pure numbers, table-driven."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.memory_split import (
    MemorySplitPolicy,
    SplitState,
    blocks_for_slots,
    movable_slots,
    slots_for_blocks,
)

# One slot holds 2.5 blocks: the exchange is in whole slots, the remainder stays unused.
BASE = SplitState(
    block_bytes=4096,
    slot_bytes=10240,
    base_blocks=100,
    base_slots=40,
    floor_slots=8,
    lent=0,
    demand_blocks=0,
)


def _budget(s: SplitState) -> int:
    return s.base_blocks * s.block_bytes + s.base_slots * s.slot_bytes


def _run(policy: MemorySplitPolicy, demands: list[int], start: SplitState = BASE) -> list[int]:
    """The lent slots after each decision, the state following each decision as the engine would."""
    s, out = start, []
    for d in demands:
        split = policy.decide(replace(s, demand_blocks=d, idle=d == 0))
        s = replace(s, lent=split.lent)
        # One budget: KV bytes + slot bytes never above it, and short of it by less than one block.
        used = split.kv_blocks * s.block_bytes + split.slots * s.slot_bytes
        assert _budget(s) - s.block_bytes < used <= _budget(s)
        assert split.kv_blocks >= s.base_blocks and split.slots >= s.floor_slots
        out.append(split.lent)
    return out


def test_exchange_arithmetic() -> None:
    assert blocks_for_slots(3, 10240, 4096) == 7  # 30720 bytes: 7 whole blocks of 4096
    assert slots_for_blocks(7, 10240, 4096) == 3
    assert slots_for_blocks(8, 10240, 4096) == 4
    assert slots_for_blocks(-5, 10240, 4096) == 0
    assert movable_slots(40, 8, 0.5) == 20
    assert movable_slots(40, 30, 0.5) == 10  # the floor binds
    assert movable_slots(40, 8, 0.0) == 0


@pytest.mark.parametrize(
    ("demands", "expected"),
    [
        # Demand above the pool: the slots that cover it go, at once.
        ([110], [4]),  # 10 blocks over: 4 slots (10 whole blocks)
        ([100], [0]),  # exactly the pool: nothing moves
        # Far above: capped at half the fast tier (20 slots = 50 blocks).
        ([400], [20]),
        # Growth follows demand step by step; a dip between the marks moves nothing.
        ([110, 130, 120, 125], [4, 12, 12, 12]),
        # Idle: everything back at once.
        ([130, 0], [12, 0]),
    ],
)
def test_lends_as_demand_rises(demands: list[int], expected: list[int]) -> None:
    assert _run(MemorySplitPolicy(max_share=0.5, quiet_steps=3), demands) == expected


def test_low_demand_gives_back_only_after_the_quiet_steps() -> None:
    policy = MemorySplitPolicy(max_share=0.5, quiet_steps=3, low_water=0.5, headroom=0.25)
    # 130 blocks: 12 slots lent (pool 130). Then 40 blocks (<= 65): two quiet steps hold, the third gives
    # back what 40 * 1.25 = 50 blocks do not need (all 12: 50 < the base 100).
    assert _run(policy, [130, 40, 40, 40]) == [12, 12, 12, 0]
    # A demand above the low-water mark in between resets the count: no flapping on a dip.
    policy = MemorySplitPolicy(max_share=0.5, quiet_steps=3, low_water=0.5)
    assert _run(policy, [130, 40, 40, 90, 40, 40]) == [12, 12, 12, 12, 12, 12]


def test_give_back_keeps_what_the_demand_needs() -> None:
    policy = MemorySplitPolicy(max_share=1.0, quiet_steps=2, low_water=0.5, headroom=0.25)
    # 32 slots lent = 80 blocks, pool 180. Demand 88 <= 90: keep slots for 110 blocks (88 * 1.25): 4.
    assert _run(policy, [180, 88, 88]) == [32, 32, 4]


def test_re_loads_of_lent_experts_stop_further_lending() -> None:
    policy = MemorySplitPolicy(max_share=0.5, max_miss_share=0.25)
    s = replace(BASE, lent=4, demand_blocks=140, miss_share=0.4)
    split = policy.decide(s)
    assert split.lent == 4 and "re-loaded" in split.reason
    assert (
        policy.decide(replace(s, miss_share=0.1)).lent == 16
    )  # cheap slots: lend what covers 40 blocks


def test_fixed_split_moves_nothing_and_says_why() -> None:
    policy = MemorySplitPolicy()
    why = "every expert is the RAM tier's buffer (zero-copy): the fast tier cannot shrink"
    split = policy.decide(replace(BASE, demand_blocks=500, fixed=why))
    assert (split.lent, split.kv_blocks, split.slots, split.reason) == (0, 100, 40, why)
    # A fast tier at its floor: nothing to lend either.
    split = policy.decide(replace(BASE, demand_blocks=500, floor_slots=40))
    assert split.lent == 0 and "nothing movable" in split.reason


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        MemorySplitPolicy(max_share=1.5)
    with pytest.raises(ValueError):
        MemorySplitPolicy(low_water=1.0)
