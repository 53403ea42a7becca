"""MoeExecutor's public surface (capabilities, lane_open, native_moe, expert_pointers) and the
adapter's native_router: what the dispatcher and engine/worker/fused_decode.py read, and what the
executor's compute strategy holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


def test_capabilities_at_cache_one(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, offload="ram", device="cpu")
    )
    try:
        ex = om.executor
        caps = ex.capabilities()
        assert caps.store_complete and caps.lane_open and caps.resident_lane
        assert not caps.cpu_experts and caps.cpu_mode == "off"
        assert (
            caps.native_lane == (ex.native_moe is not None) and ex.native_moe is ex.compute.native
        )
        assert caps.grouped == ex.compute.grouped_ok
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.lane_open = False  # type: ignore[misc]
        if ex.native_moe is not None:
            layer, E = om.moe_layers[0], om.num_experts
            assert ex.expert_pointers(layer) == [
                ex.compute.pointers[om.store.slot_index(layer * E + e)] for e in range(E)
            ]
    finally:
        om.close()


def test_capabilities_follow_what_the_loader_attaches(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=0.5, offload="ram", device="cpu", cpu_experts="auto"),
    )
    try:
        caps = om.executor.capabilities()
        assert caps.cpu_experts and caps.cpu_mode == "auto"
        assert not caps.store_complete and not caps.lane_open and not caps.resident_lane
        assert om.executor.lane_open() is False
    finally:
        om.close()


def test_the_adapters_native_router_is_decided_on_the_first_one_token_step(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, offload="ram", device="cpu")
    )
    try:
        block = om.model.get_submodule(f"model.layers.{om.moe_layers[0]}.mlp")
        assert block.adapter.native_router is None
        with torch.inference_mode():
            generate(om, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert block.adapter.native_router is block.adapter._native_router is not None
    finally:
        om.close()


def test_no_resident_lane_closes_the_lane_and_says_so(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=1.0, offload="ram", device="cpu", resident_lane=False),
    )
    try:
        caps = om.executor.capabilities()
        assert caps.store_complete and not caps.lane_open and not caps.resident_lane
        assert om.plan.to_dict()["experts"]["chosen"] == "planned"
    finally:
        om.close()
