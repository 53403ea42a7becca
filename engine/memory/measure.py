"""The memory plan of a model about to load: its footprint, measured against this machine.

`plan_for_model` is what load_model calls once the model exists on the meta device (nothing
allocated yet); `probe_checkpoint` builds the same meta model from config.json and the safetensors
headers for `moe-offload plan` and for `serve`'s check before it listens."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from engine.config import EngineConfig
from engine.memory.footprint import Footprint, footprint
from engine.memory.machine import device_memory, host_memory
from engine.memory.planner import KvRequest, MemoryPlan, plan_memory
from engine.weights.checkpoint import TensorLocation


def plan_for_model(
    model: nn.Module,
    experts: list[nn.Module],
    config: PretrainedConfig,
    dtype: torch.dtype,
    slot_bytes: int,
    expert_disk_bytes: int,
    E: int,
    I: int,
    top_k: int,
    tensors: dict[str, TensorLocation],
    cfg: EngineConfig,
    device: torch.device,
    kv_request: KvRequest = KvRequest(),
    dense_on_disk_bytes: int = 0,
) -> tuple[Footprint, MemoryPlan]:
    fp = footprint(
        model,
        experts,
        config,
        dtype=dtype,
        slot_bytes=slot_bytes,
        expert_disk_bytes=expert_disk_bytes,
        experts_per_layer=E,
        top_k=top_k,
        moe_intermediate=I,
        tensors=tensors,
        dense_on_disk_bytes=dense_on_disk_bytes,
        dense_saved_bytes=dense_saved(model, tensors, cfg, device),
    )
    dev = str(device) if device.type == "cuda" else "cpu"
    free = device_memory(dev if device.index is not None or dev == "cpu" else "cuda:0")
    from engine.memory.machine import rss_bytes

    return fp, plan_memory(
        fp,
        cfg,
        dev,
        host_memory(),
        device_free=free[0] if free else None,
        runtime_bytes=rss_bytes(),
        kv_request=kv_request,
    )


def dense_saved(
    model: nn.Module,
    tensors: dict[str, TensorLocation],
    cfg: EngineConfig,
    device: torch.device,
) -> int:
    """Dense bytes the load will not hold in the compute dtype: --dense-quant int8 codes, and an f32
    model's bf16 dense weights where the native kernels read them (the loader's rule for narrow_dense)."""
    from engine.native.quant_linear import dense_bytes_saved, narrows_dense

    dtypes = {name: t.dtype for name, t in tensors.items()}
    return dense_bytes_saved(model, dtypes, cfg.dense_quant, narrows_dense(cfg.bf16_dense, device))


def print_plan(plan: MemoryPlan) -> None:
    """Every start prints its plan (stderr: stdout stays the generated text or JSON)."""
    print(plan.table(), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ExpertRead:
    """One expert as the disk tier reads it: a byte range of one file, or (`parts`, when its tensors do
    not lie side by side: gpt-oss's per-layer expert tensors) one read per tensor."""

    path: Path
    offset: int
    nbytes: int  # every byte the transfer moves (the parts' sum where there are parts)
    parts: tuple[tuple[int, int], ...] = ()  # (offset, nbytes) of each separate read, in `path`


@dataclass(frozen=True)
class Probe:
    """A checkpoint described from its headers: what `plan` reports and serve checks."""

    footprint: Footprint
    model_type: str
    expert_format: str  # e.g. "none" (float experts), "int8", "mxfp4"
    device: torch.device
    sidecar_bytes: int
    config: Any = None  # the text config (for the kernels' decode shapes)
    moe_intermediate: int = 0
    # Dense bytes a decode token streams: the dense part less an untied embedding table (only gathered).
    dense_streamed_bytes: int = 0
    # Expert-sized byte ranges as the disk tier will read them (the quantized sidecar once it exists),
    # spread over layers and experts: what `plan --hardware measured` times the disk on.
    expert_reads: tuple[ExpertRead, ...] = ()


def probe_checkpoint(model_dir: str | Path, cfg: EngineConfig) -> Probe:
    """Footprint of a checkpoint from config.json and safetensors headers only (no weights read)."""
    from engine.experts.formats.expert_source import CheckpointExperts, float_expert_format
    from engine.weights.arch import arch_for, text_config
    from engine.weights.checkpoint import index_checkpoint
    from engine.weights.disk_embedding import disk_embedding_source, resident_bytes
    from engine.weights.model_config import read_config, resolve_device, resolve_dtype
    from engine.weights.moe_hook import find_moe_sites

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    spec = arch_for(config.model_type)
    config = text_config(spec, config)
    tensors = index_checkpoint(model_dir)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, config, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sites = find_moe_sites(model)
    from engine.errors import CheckpointError

    if not sites:
        raise CheckpointError(
            f"{model_dir / 'config.json'}: no sparse MoE layers in this configuration"
        )
    source = CheckpointExperts.of_sites(spec, config, tensors, sites, dtype, device)
    layers, E, top_k = source.moe_layers, source.num_experts, source.top_k
    I, kernel = source.shape.intermediate, source.kernel
    experts: list[nn.Module] = [s.block.get_submodule("experts") for s in sites]
    native = source.shipped()
    sidecar = 0
    fmt: Any
    locator: Any
    if native is not None:
        fmt, locator = native
    else:
        locator = source.float_locator()
        fmt = float_expert_format(kernel, cfg, dtype, locator, device)
        if cfg.expert_quant != "none":
            sidecar = len(layers) * E * fmt.slot_bytes
    embedding = disk_embedding_source(
        model,
        config,
        spec,
        tensors=tensors,
        dtype=dtype,
        device=device,
        enabled=cfg.embedding_on_disk,
    )
    fp = footprint(
        model,
        experts,
        config,
        dtype=dtype,
        slot_bytes=fmt.slot_bytes,
        expert_disk_bytes=locator.nbytes_on_disk(layers[0], 0),
        experts_per_layer=E,
        top_k=top_k,
        moe_intermediate=I,
        tensors=tensors,
        dense_on_disk_bytes=embedding.nbytes - resident_bytes(embedding) if embedding else 0,
        dense_saved_bytes=dense_saved(model, tensors, cfg, device),
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = 0 if tied else fp.vocab * fp.hidden * itemsize
    if cfg.expert_quant != "none" and native is None:
        from engine.experts.formats.quant_cache import (
            SidecarLocator,
            default_cache_dir,
            sidecar_path,
        )

        path = sidecar_path(locator, fmt, layers, Path(cfg.quant_cache_dir or default_cache_dir()))
        if path.exists():
            locator = SidecarLocator(path, layers, E, fmt.slot_numel)
    return Probe(
        fp,
        str(config.model_type),
        fmt.name,
        device,
        sidecar,
        config=config,
        moe_intermediate=I,
        dense_streamed_bytes=max(0, fp.dense_bytes + fp.dense_on_disk_bytes - embed),
        expert_reads=_expert_reads(locator, layers, E),
    )


def _expert_reads(locator: Any, layers: list[int], E: int, n: int = 128) -> tuple[ExpertRead, ...]:
    """`n` experts' byte ranges (each expert's segments in its first segment's file, first to last
    byte), layer by layer and spread over the experts, as the disk tier reads them."""
    from engine.experts.tiers.slow_tier import _one_span

    out = []
    for i in range(min(n, len(layers) * E)):
        layer, e = layers[i % len(layers)], (i // len(layers) * 37 + i) % E
        segs = list(locator.segments(layer, e))
        same = [s for s in segs if s.path == segs[0].path]
        span = _one_span(same)
        if (
            span is not None
        ):  # one read, as the disk tier makes it (slow_tier.UncachedDiskTier._fetch)
            out.append(ExpertRead(Path(segs[0].path), span[0], span[1] - span[0]))
            continue
        parts = tuple((s.offset, s.nbytes) for s in same)
        out.append(ExpertRead(Path(segs[0].path), parts[0][0], sum(b for _, b in parts), parts))
    return tuple(out)


def plan_checkpoint(
    model_dir: str | Path, cfg: EngineConfig, kv_request: KvRequest = KvRequest()
) -> tuple[Probe, MemoryPlan]:
    """The plan `serve` would make for this checkpoint on this machine (ConfigError if it cannot fit)."""
    probe = probe_checkpoint(model_dir, cfg)
    dev = str(probe.device) if probe.device.type == "cuda" else "cpu"
    free = device_memory("cuda:0" if dev == "cuda" else dev)
    from engine.experts.formats.quant_cache import default_cache_dir
    from engine.memory.machine import disk_free

    quant_dir = cfg.quant_cache_dir or default_cache_dir()
    return probe, plan_memory(
        probe.footprint,
        cfg,
        dev,
        host_memory(),
        device_free=free[0] if free else None,
        sidecar_bytes=probe.sidecar_bytes,
        sidecar_disk_free=disk_free(quant_dir) if probe.sidecar_bytes else None,
        kv_request=kv_request,
    )


def memory_probe(plan: MemoryPlan, model: nn.Module, store: object, tier: object):
    """A callable returning {pool: {"planned": bytes, "used": bytes}}: the plan beside what the
    process holds now. Used bytes are measured where one object holds the pool (dense parameters,
    the fast tier's slots, the RAM tier's buffers) and, for the whole process, its resident set
    and (on a GPU) the bytes torch has allocated."""
    from engine.memory.machine import rss_bytes

    planned = plan.planned()
    dense = sum(
        p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
    )
    slots = getattr(store, "slots", None)
    fast = 0 if plan.zero_copy or slots is None else slots.numel() * slots.element_size()
    slow = int(getattr(tier, "nbytes", 0))

    def probe() -> dict[str, dict[str, int]]:
        out = {name: {"planned": b} for name, b in planned.items()}
        out["dense"]["used"] = dense
        out["fast_tier"]["used"] = fast
        out["slow_tier"]["used"] = slow
        out["slow_tier_pageable"] = {"planned": 0, "used": int(getattr(tier, "pageable_bytes", 0))}
        out["host_total"] = {"planned": plan.total("host"), "used": rss_bytes()}
        if plan.device_budget is not None:
            out["device_total"] = {
                "planned": plan.total("device"),
                "used": int(torch.cuda.memory_allocated()),
            }
        return out

    return probe
