"""The KV/expert split, carried out: memory moves between the paged KV pool and the experts' fast tier.

The memory plan (planner.py) sizes the KV pool (`base_blocks`, one context at least) and the fast tier
(`base_slots`) from one budget. Under load the engine lends expert slots to the KV pool, idle it gives
them back; policies/memory_split.py decides how many, this module moves them, on the scheduler thread
between steps (EngineCore.step calls `rebalance`), so no forward runs while it does:

- lend: the fast tier takes `n` slots out of use (ExpertStore.withdraw: free slots first, then the
  eviction policy's victims, evicted through the normal path; pinned or loading experts stay) and hands
  their pages back to the OS (madvise MADV_DONTNEED); the scheduler's block accounting (KVBlocks.resize)
  grows by the whole blocks those bytes hold. The pool's tensors were allocated at the most it may
  reach with torch.empty, so blocks never used cost no memory, and a new block's pages are touched
  only when a request writes it.
- give back: the cached prefixes in the blocks that go move into free blocks below (copied, most
  recently used first: a returning session's history survives where there is room; the rest is
  evicted), the block accounting shrinks (it stops above a block a request holds), the released
  blocks' pages go back to the OS, and the fast tier takes the slots back as free slots, which misses
  and prefetches fill the usual way.

Exactness does not depend on it: which experts are resident never changes what a row computes (a miss
loads the same weights), and a block's id never changes what attention reads.

Only where it applies: the CPU's paged pool (engine/worker/kv_pool.py) and a fast tier smaller than
every expert, with a RAM or disk tier behind it. A fast tier holding every expert stays whole: at cache
1.0 in RAM it is the RAM tier's own buffer (zero-copy), and the execution plan's complete-tier paths
count on every expert being resident (engine/worker/loader.py `_plan`).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.budget import fmt_bytes
from engine.core.kv_blocks import KVBlocks
from policies.memory_split import (
    MemorySplitPolicy,
    SplitState,
    blocks_for_slots,
    slots_for_blocks,
)

log = logging.getLogger(__name__)


class MemorySplit:
    """One engine's split between its KV pool (`pool`, engine/worker/kv_pool.py) and its fast tier (`store`)."""

    def __init__(
        self,
        policy: MemorySplitPolicy,
        store: Any,
        base_blocks: int,
        block_bytes: int,
        floor_slots: int,
        stats: Any = None,
        fixed: str = "",
    ) -> None:
        self.policy, self.store, self.stats = policy, store, stats
        self.pool: Any = None  # the KVPool whose pages a give-back releases (set once it exists)
        self.base_blocks, self.base_slots = base_blocks, store.capacity
        self.floor_slots, self.fixed = min(floor_slots, self.base_slots), fixed
        self.block_bytes, self.slot_bytes = block_bytes, store.slot_bytes
        self.lent = 0  # slots the fast tier lends the KV pool now
        self.moves = 0  # lends and give-backs since start
        self.reason = fixed or "no move yet"
        self._seen = (0, 0)  # (expert lookups, ghost loads) at the last decision

    # -- the range ------------------------------------------------------------------------------
    def state(
        self, demand_blocks: int = 0, idle: bool = False, miss_share: float = 0.0
    ) -> SplitState:
        return SplitState(
            self.block_bytes,
            self.slot_bytes,
            self.base_blocks,
            base_slots=self.base_slots,
            floor_slots=self.floor_slots,
            lent=self.lent,
            demand_blocks=demand_blocks,
            idle=idle,
            miss_share=miss_share,
            fixed=self.fixed,
        )

    def max_blocks(self) -> int:
        """The most blocks the pool may reach: its base and the bytes of every movable slot."""
        if self.fixed:
            return self.base_blocks
        return self._blocks(self.policy.cap(self.state()))

    def line(self) -> str:
        """The split and its movable range, for the start-up line."""
        return split_line(
            self.base_blocks * self.block_bytes,
            self.base_slots,
            self.slot_bytes,
            movable=self.policy.cap(self.state()) if not self.fixed else 0,
            block_bytes=self.block_bytes,
            share=self.policy.max_share,
            fixed=self.fixed,
        )

    # -- between steps --------------------------------------------------------------------------
    def rebalance(self, blocks: KVBlocks, demand_blocks: int, idle: bool) -> None:
        """Decide and move (module docstring); publish the split to the model's stats (/metrics)."""
        if not self.fixed:
            split = self.policy.decide(self.state(demand_blocks, idle, self._miss_share()))
            if split.lent != self.lent:
                before = self.lent
                if split.lent > self.lent:
                    self._lend(blocks, split.lent - self.lent)
                else:
                    self._give_back(blocks, split.lent)
                if self.lent != before:
                    self.moves += 1
                    self.reason = split.reason
                    log.info(
                        "memory split: %s; KV pool %d blocks, fast tier %d slots",
                        split.reason,
                        blocks.total,
                        self.store.capacity,
                    )
        self._publish(blocks)

    def _lend(self, blocks: KVBlocks, n: int) -> None:
        self.lent += self.store.withdraw(n)
        blocks.resize(self._blocks(self.lent))

    def _give_back(self, blocks: KVBlocks, lent: int) -> None:
        old = blocks.total
        if self.pool is not None:  # cached prefixes up there move into free blocks below first
            self.pool.copy_blocks(blocks.relocate(self._blocks(lent)))
        now = blocks.resize(self._blocks(lent))
        # A block a request holds stops the shrink: keep the slots whose bytes cover the blocks still there.
        keep = max(
            lent, slots_for_blocks(now - self.base_blocks, self.slot_bytes, self.block_bytes)
        )
        now = blocks.resize(self._blocks(keep))
        if now < old and self.pool is not None:
            self.pool.release(now, old)
        self.lent -= self.store.restore(self.lent - keep)

    def _blocks(self, lent: int) -> int:
        """The pool's blocks with `lent` slots lent: its base and the whole blocks their bytes hold."""
        return self.base_blocks + blocks_for_slots(lent, self.slot_bytes, self.block_bytes)

    def _miss_share(self) -> float:
        """Of the expert lookups since the last decision, the share that loaded a lent-away expert again."""
        lookups = _lookups(self.stats)
        ghosts = self.store.res.ghost_loads
        d_lookups, d_ghosts = lookups - self._seen[0], ghosts - self._seen[1]
        self._seen = (lookups, ghosts)
        return d_ghosts / d_lookups if d_lookups > 0 else 0.0

    def _publish(self, blocks: KVBlocks) -> None:
        if self.stats is not None and hasattr(self.stats, "set_memory_split"):
            self.stats.set_memory_split(
                blocks.total * self.block_bytes, self.store.capacity * self.slot_bytes, self.moves
            )


def _lookups(stats: Any) -> int:
    if stats is None:
        return 0
    return sum(getattr(stats, "hits", ())) + sum(getattr(stats, "misses", ()))


def split_line(
    kv_bytes: int,
    slots: int,
    slot_bytes: int,
    movable: int,
    block_bytes: int,
    share: float,
    fixed: str = "",
) -> str:
    """'memory split: KV a + experts b = c; ...': the split at start and how far it may move."""
    head = (
        f"memory split: KV {fmt_bytes(kv_bytes)} + experts {fmt_bytes(slots * slot_bytes)} ({slots} slots) "
        f"= {fmt_bytes(kv_bytes + slots * slot_bytes)}"
    )
    if fixed:
        return f"{head}; fixed: {fixed}"
    if movable == 0:
        return f"{head}; fixed: nothing movable (--kv-borrow-share {share:g}, or the fast tier is at its floor)"
    extra = blocks_for_slots(movable, slot_bytes, block_bytes)
    return (
        f"{head}; under load the KV pool may borrow up to {movable} expert slots ({fmt_bytes(movable * slot_bytes)}, "
        f"{extra} blocks), given back when idle (--kv-borrow-share {share:g})"
    )


def memory_split_for(lm: Any, base_blocks: int, block_bytes: int) -> MemorySplit | None:
    """The split of a loaded model's KV pool of `base_blocks` blocks of `block_bytes` and its fast tier;
    None where it has no fast tier. Where nothing may move, the split says why (`fixed`)."""
    store, plan = getattr(lm, "store", None), getattr(lm, "memory_plan", None)
    if store is None or plan is None:
        return None
    share = getattr(getattr(lm, "engine_config", None), "kv_borrow_share", 0.0)
    floor = min(getattr(lm, "top_k", 1), store.capacity)  # the plan's minimum: one token's top-k
    policy = MemorySplitPolicy(max_share=share)
    return MemorySplit(
        policy,
        store,
        base_blocks,
        block_bytes=block_bytes,
        floor_slots=floor,
        stats=getattr(lm, "stats", None),
        fixed=fixed_why(plan),
    )


def fixed_why(plan: Any) -> str:
    """Why the split of a memory plan (planner.py MemoryPlan) cannot move, or "" where it can."""
    if plan.n_slots >= plan.total_experts:
        return (
            "every expert is the RAM tier's buffer (zero-copy): the fast tier cannot shrink"
            if plan.zero_copy
            else "the fast tier holds every expert, which the execution plan's complete-tier paths count on"
        )
    if str(plan.device) != "cpu":
        return "only on the CPU, where the KV pool is paged"
    return ""
