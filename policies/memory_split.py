"""How one memory budget is split between the KV pool and the experts' fast tier, under load.

The memory plan (engine/memory/planner.py) sizes both from one budget: a KV pool of `base_blocks`
(at least one whole context) and a fast tier of `base_slots` expert slots. Under load, sessions need
KV blocks that the plan gave to experts; idle, those blocks earn nothing and the experts could use
them. This policy says where the line is, in whole expert slots: the fast tier lends `lent` slots
and the KV pool grows by the blocks those slots' bytes hold, so KV bytes + slot bytes stay the
budget (the remainder of a slot that does not fill a whole block stays unused).

The rules (`MemorySplitPolicy.decide`, called between engine steps):
- KV demand (blocks held by running requests plus those waiting requests want) above the pool:
  lend the slots that cover it, up to the cap (`movable_slots`: a share of the fast tier, never
  below its floor). Which experts leave is the eviction policy's choice (its least useful end).
- The slots already lent are worth what they cost: `miss_share`, the share of recent expert
  lookups that re-loaded an expert the split took away (a ghost hit, as in ARC). Above
  `max_miss_share` no more slots are lent: the KV pool then waits (the scheduler queues or preempts,
  exactly), rather than the experts thrashing.
- Demand well below the pool (at most `low_water` of it) for `quiet_steps` decisions in a row:
  give back the slots beyond what the demand, with `headroom`, needs. That is the hysteresis: a
  dip of a few steps, or a demand between the marks, moves nothing.
- Nothing running or waiting: give everything back at once (no KV is needed; the experts refill
  through the normal admission on the next misses).

Pure: numbers in, numbers out; the engine (engine/memory/split.py) moves the memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitState:
    """What the decision sees, in blocks and slots (and their bytes)."""

    block_bytes: int  # one KV block, every layer's keys and values
    slot_bytes: int  # one expert slot
    base_blocks: int  # the plan's KV pool: one context at least; never below it
    base_slots: int  # the plan's fast tier: what it holds when nothing is lent
    floor_slots: int  # the fewest slots the fast tier keeps (the plan's minimum: one token's top-k)
    lent: int  # slots lent to the KV pool now
    demand_blocks: int  # blocks running requests hold plus the blocks waiting requests want
    idle: bool = False  # nothing running, nothing waiting
    miss_share: float = (
        0.0  # of the expert lookups since the last decision, re-loads of lent-away experts
    )
    fixed: str = (
        ""  # why nothing may move here (zero-copy experts, no paged pool...); "" where it may
    )

    @property
    def kv_blocks(self) -> int:
        return self.base_blocks + blocks_for_slots(self.lent, self.slot_bytes, self.block_bytes)


@dataclass(frozen=True)
class Split:
    """The target: `lent` slots lent, so the pool holds `kv_blocks` and the fast tier `slots`."""

    lent: int
    kv_blocks: int
    slots: int
    reason: str


def blocks_for_slots(slots: int, slot_bytes: int, block_bytes: int) -> int:
    """The whole KV blocks the bytes of `slots` expert slots hold."""
    return slots * slot_bytes // block_bytes


def slots_for_blocks(blocks: int, slot_bytes: int, block_bytes: int) -> int:
    """The fewest whole slots whose bytes hold `blocks` KV blocks."""
    return -(-max(0, blocks) * block_bytes // slot_bytes)


def movable_slots(base_slots: int, floor_slots: int, max_share: float) -> int:
    """The most slots the fast tier lends: `max_share` of it, never taking it below its floor."""
    return max(0, min(base_slots - floor_slots, int(base_slots * max_share)))


class MemorySplitPolicy:
    """The rules in the module docstring; it remembers only how long demand has been low."""

    def __init__(
        self,
        max_share: float = 0.5,
        quiet_steps: int = 64,
        low_water: float = 0.5,
        headroom: float = 0.25,
        max_miss_share: float = 0.25,
    ) -> None:
        if not 0.0 <= max_share <= 1.0:
            raise ValueError(f"the movable share must be in [0, 1], got {max_share}")
        if quiet_steps < 1 or not 0.0 < low_water < 1.0 or headroom < 0.0:
            raise ValueError("quiet_steps >= 1, low_water in (0, 1) and headroom >= 0")
        self.max_share, self.quiet_steps = max_share, quiet_steps
        self.low_water, self.headroom, self.max_miss_share = low_water, headroom, max_miss_share
        self._quiet = 0  # decisions in a row with demand at most low_water of the pool

    def cap(self, s: SplitState) -> int:
        return movable_slots(s.base_slots, s.floor_slots, self.max_share)

    def decide(self, s: SplitState) -> Split:
        cap = self.cap(s)
        if s.fixed or cap == 0:
            self._quiet = 0
            why = s.fixed or (
                f"nothing movable: the fast tier's {s.base_slots} slots are at its floor "
                f"({s.floor_slots}) or the movable share is {self.max_share:g}"
            )
            return self._split(s, s.lent, why)
        if s.idle:
            self._quiet = 0
            return self._split(s, 0, "idle: every lent slot goes back to the experts")
        pool, need = s.kv_blocks, s.demand_blocks - s.base_blocks
        want = min(cap, slots_for_blocks(need, s.slot_bytes, s.block_bytes))
        if s.demand_blocks > pool:
            self._quiet = 0
            if want <= s.lent:
                return self._split(
                    s,
                    s.lent,
                    f"KV demand {s.demand_blocks} > pool {pool} blocks; at the cap ({cap} slots)",
                )
            if s.lent and s.miss_share > self.max_miss_share:
                return self._split(
                    s,
                    s.lent,
                    f"KV demand {s.demand_blocks} > pool {pool} blocks, but the lent slots' experts are re-loaded on "
                    f"{s.miss_share:.0%} of lookups (> {self.max_miss_share:.0%}): no more slots go",
                )
            return self._split(
                s,
                want,
                f"KV demand {s.demand_blocks} > pool {pool} blocks: lend {want - s.lent} slots",
            )
        if s.lent and s.demand_blocks <= self.low_water * pool:
            self._quiet += 1
            if self._quiet >= self.quiet_steps:
                self._quiet = 0
                keep = min(
                    s.lent,
                    slots_for_blocks(
                        int(s.demand_blocks * (1 + self.headroom)) - s.base_blocks,
                        s.slot_bytes,
                        s.block_bytes,
                    ),
                )
                return self._split(
                    s,
                    keep,
                    f"KV demand {s.demand_blocks} <= {self.low_water:.0%} of pool {pool} blocks for {self.quiet_steps} steps: {s.lent - keep} slots go back",
                )
            return self._split(
                s, s.lent, f"KV demand low for {self._quiet} of {self.quiet_steps} steps"
            )
        self._quiet = 0
        return self._split(s, s.lent, f"KV demand {s.demand_blocks} fits the pool of {pool} blocks")

    @staticmethod
    def _split(s: SplitState, lent: int, reason: str) -> Split:
        blocks = s.base_blocks + blocks_for_slots(lent, s.slot_bytes, s.block_bytes)
        return Split(lent, blocks, s.base_slots - lent, reason)
