"""KV and experts share one budget, on a tiny model (engine/memory/split.py): with more sessions than the
planned KV pool holds, the pool borrows expert slots (the split moves, in the stats /metrics reads); idle,
the experts take them back; and every request gets, bit for bit, the tokens and logprobs it gets alone."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import tokens_and_logprobs

from engine.config import EngineConfig
from engine.core.engine_core import CoreLimits, EngineCore
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# The pool: 60 positions planned, raised to one whole context (128): 8 blocks of 16. Each request needs 3.
LIMITS = CoreLimits(max_running=8, prefill_token_budget=256, max_model_len=128)


def _generate(om, prompts: list[list[int]], seen: list[tuple[int, int, int]] | None = None):
    """Each prompt's (token, logprob) pairs; `seen` gets (KV blocks, fast-tier slots, moves) after each step."""
    core = EngineCore.for_model(om, LIMITS)

    def watch() -> None:
        blocks = core.scheduler.blocks
        assert blocks is not None
        if seen is not None:
            seen.append((blocks.total, om.store.capacity, om.stats.memory_split_moves))

    reqs = [core.local_request(p, dataclasses.replace(PARAMS), logprobs=0) for p in prompts]
    return tokens_and_logprobs(core, reqs, watch), core


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_sessions_borrow_expert_slots_and_idle_gives_them_back(tiny_ckpt, offload: str) -> None:
    cfg = EngineConfig(device="cpu", kv_tokens=60, cache_fraction=0.5, offload=offload)
    om = load_model(tiny_ckpt("qwen3_moe"), cfg)
    base_slots = om.store.capacity
    prompts = [[(7 * i + j) % 200 + 3 for j in range(25)] for i in range(8)]
    seen: list[tuple[int, int, int]] = []
    together, core = _generate(om, prompts, seen)
    split = core.split
    assert split is not None and not getattr(split, "fixed", "x"), "the split should apply here"
    base_blocks = split.base_blocks  # type: ignore[attr-defined]
    # Under load: the pool grew past its base by the slots the fast tier lent, in one budget.
    assert max(b for b, _, _ in seen) > base_blocks
    assert min(s for _, s, _ in seen) < base_slots
    for blocks, slots, _ in seen[:-1]:
        lent = base_slots - slots
        assert (blocks - base_blocks) * split.block_bytes <= lent * split.slot_bytes  # type: ignore[attr-defined]
    assert om.stats.evictions > 0
    # Idle (the last step finished every request): the experts took everything back.
    assert seen[-1][:2] == (base_blocks, base_slots)
    kv_bytes, expert_bytes = om.stats.memory_split
    assert expert_bytes == base_slots * om.store.slot_bytes
    assert kv_bytes == base_blocks * split.block_bytes  # type: ignore[attr-defined]
    assert om.stats.memory_split_moves >= 2
    # Exactness does not depend on residency: each request alone (no move: one request fits the base).
    alone = [_generate(om, [p])[0][0] for p in prompts]
    om.close()
    assert together == alone and all(len(t) == 12 for t in together)  # tokens and logprobs, bitwise
    # The same load with the split fixed (--kv-borrow-share 0) waits and preempts more: more steps.
    fixed = load_model(tiny_ckpt("qwen3_moe"), dataclasses.replace(cfg, kv_borrow_share=0.0))
    steps: list[tuple[int, int, int]] = []
    try:
        same, core0 = _generate(fixed, prompts, steps)
    finally:
        fixed.close()
    assert same == together and fixed.stats.memory_split_moves == 0
    assert len(steps) > len(seen) and core0.scheduler.preemptions >= core.scheduler.preemptions


def test_every_expert_in_ram_keeps_the_split_fixed(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", kv_tokens=60))
    try:
        _, core = _generate(om, [[(7 * i + j) % 200 + 3 for j in range(25)] for i in range(8)])
        split = core.split
        assert split is not None and "zero-copy" in split.fixed  # type: ignore[attr-defined]
        assert om.stats.memory_split_moves == 0 and core.scheduler.preemptions > 0
    finally:
        om.close()


def test_a_returning_session_finds_its_history_after_the_give_back(tiny_ckpt) -> None:
    """A prefix cached in borrowed blocks is copied into free base blocks when they go back; a returning
    request reads it there and gets the bits it gets alone."""
    cfg = EngineConfig(device="cpu", kv_tokens=60, cache_fraction=0.5, offload="ram")
    om = load_model(tiny_ckpt("qwen3_moe"), cfg)
    prompt = [(5 * j) % 200 + 3 for j in range(40)]
    try:
        first, _ = _generate(om, [prompt])  # alone, in a core of its own
        core = EngineCore.for_model(om, LIMITS)
        one = [core.local_request(prompt, dataclasses.replace(PARAMS), logprobs=0)]
        blocks, split = core.scheduler.blocks, core.split
        assert blocks is not None and split is not None
        split.rebalance(blocks, 18, False)  # borrow: 4 slots, 12 blocks past the base's 8
        assert blocks.total == 20
        assert blocks.allocate("filler", 8 * 16) and blocks.table("filler") == list(range(8))
        core.split = None  # held still while the request runs in borrowed blocks
        assert tokens_and_logprobs(core, one) == first
        assert blocks.counts().cached == 3  # 52 positions: 3 whole blocks, all at 8 and above
        blocks.free("filler")
        core.split = split
        split.rebalance(blocks, 0, True)  # idle: the blocks go back, the prefix moves into the base
        assert blocks.total == 8 and blocks.counts().cached == 3
        hit = blocks.hit_tokens
        again = [core.local_request(prompt, dataclasses.replace(PARAMS), logprobs=0)]
        assert tokens_and_logprobs(core, again) == first  # read from the copied blocks, same bits
        assert blocks.hit_tokens - hit == 32  # the prompt's whole blocks short of its last token
    finally:
        om.close()


def test_the_split_is_published_before_the_first_step(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", kv_tokens=60, cache_fraction=0.5)
    )
    try:
        core = EngineCore.for_model(om, LIMITS)
        assert core.split is not None
        assert om.stats.memory_split == (
            8 * core.split.block_bytes,
            om.store.capacity * om.store.slot_bytes,
        )  # type: ignore[attr-defined]
    finally:
        om.close()
