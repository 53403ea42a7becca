"""The routed experts' slot format and locator as a load builds them: the decision of
engine/experts/formats/checkpoint_experts.py made with the formats that encode and compute
(engine/experts/formats/quant.py, native_quant.py), a quantized sidecar written once where
--expert-quant asks (engine/experts/formats/quant_cache.py), and the experts of a built model's
sparse blocks."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from engine.config import EngineConfig
from engine.experts.formats.checkpoint_experts import (
    CheckpointExperts,
    fp8_block_edge,
    slot_format,
)
from engine.experts.formats.expert_kernels import make_kernel
from engine.experts.formats.native_quant import FORMATS, dequant_fp8_block
from engine.experts.formats.quant import ExpertFormat, GroupQuantFormat
from engine.experts.formats.quant_cache import quantized_locator
from engine.weights.arch import ArchSpec
from engine.weights.checkpoint import read_tensor
from engine.weights.expert_layout import ExpertLocator, ExpertShape, SegmentLocator
from engine.weights.moe_hook import MoeSite, expert_geometry
from engine.weights.safetensors_index import TensorLocation


def experts_of_sites(
    spec: ArchSpec,
    config: PretrainedConfig,
    tensors: dict[str, TensorLocation],
    sites: list[MoeSite],
    dtype: str,
    device: str,
) -> CheckpointExperts:
    """The experts of a model's sparse blocks `sites`: their geometry, read off the first block,
    and what an expert computes (the architecture's kernel)."""
    block = sites[0].block
    E, H, I, top_k = expert_geometry(block, transposed=spec.kernel != "swiglu")
    return CheckpointExperts(
        spec=spec,
        config=config,
        tensors=tensors,
        moe_layers=[s.layer for s in sites],
        num_experts=E,
        shape=ExpertShape(hidden=H, intermediate=I),
        kernel=make_kernel(spec.kernel, block.get_submodule("experts"), H, I),
        dtype=dtype,
        device=device,
        top_k=top_k,
    )


def expert_source(
    experts: CheckpointExperts, cfg: EngineConfig, native: bool
) -> tuple[ExpertFormat, SegmentLocator]:
    fmt, locator = slot_format(experts, cfg, native, FORMATS)
    assert isinstance(fmt, ExpertFormat)  # FORMATS' classes compute
    if cfg.expert_quant != "none":
        assert isinstance(fmt, GroupQuantFormat)  # the format for int8/int4
        assert isinstance(locator, ExpertLocator)
        return fmt, quantized_locator(
            locator, fmt, experts.moe_layers, cfg.quant_cache_dir
        )  # sidecar, built once
    return fmt, locator


def read_dense(
    tensors: dict[str, TensorLocation], loc: TensorLocation, config: PretrainedConfig
) -> torch.Tensor:
    """A dense (non-expert) weight; FP8 block-quantized ones are dequantized with their scales."""
    t = read_tensor(loc)
    scale = tensors.get(f"{loc.name}_scale_inv")
    if scale is None or t.dim() != 2:
        return t
    return dequant_fp8_block(t, read_tensor(scale), fp8_block_edge(config), torch.float32)
