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


def test_nothing_planned_around_misses_slows_a_model_whose_experts_are_all_resident(
    tiny_ckpt,
) -> None:
    """At cache 1.0 nothing can miss, so CPU-run experts and the utility estimator have nothing to decide:
    the plan and the executor keep the resident lane, decode steps take the fused path, and the tokens
    and logprobs are bitwise the plain configuration's. (They took the per-layer plan, 3-4x slower.)"""
    from engine.core.completion import generate

    spac = dict(cpu_experts="auto", prefetch="utility", eviction="utility")
    got = {}
    for name, over in (("plain", {}), ("spac", spac)):
        om = load_model(
            tiny_ckpt("qwen3_moe"),
            EngineConfig(cache_fraction=1.0, offload="ram", device="cpu", **over),
        )
        try:
            caps = om.executor.capabilities()
            assert caps.store_complete and caps.lane_open and caps.resident_lane, name
            assert om.plan.to_dict()["experts"]["chosen"] == "resident lane", name
            assert (om.executor.cpu is not None) == (name == "spac")
            c = generate(
                om, [3, 4, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True), logprobs=0
            )
            assert set(om.stats.snapshot()["steps"]["decode"]) == {"fused"}, name
            got[name] = (c.token_ids, [lp.logprob for lp in c.logprobs])
        finally:
            om.close()
    assert got["spac"] == got["plain"]
