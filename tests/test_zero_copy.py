"""Both tiers in host memory at cache 1.0: the RAM tier's buffer is the fast tier, no second copy."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


def test_cache_one_on_cpu_shares_the_ram_tier(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, offload="ram", device="cpu")
    )
    try:
        assert (
            om.store.slots.data_ptr() == om.transfers.tier.buffer.data_ptr()
        )  # one copy of every expert
        out = generate(om, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        s = om.stats.snapshot()
        assert len(out.token_ids) == 8 and s["misses"] == 0 and sum(s["transfers"].values()) == 0
    finally:
        om.close()


def test_a_smaller_fast_tier_keeps_its_own_slots(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.5, offload="ram", device="cpu")
    )
    try:
        assert om.store.slots.data_ptr() != om.transfers.tier.buffer.data_ptr()
        assert om.store.slots.shape[0] < om.transfers.tier.buffer.shape[0]
    finally:
        om.close()
