"""A checkpoint described from its headers for `moe-offload plan`'s projection of decode speed: its
footprint, experts' format, the dense bytes a decode token streams, and expert-sized reads as the disk
tier makes them (what `--hardware measured` times the disk on). No weight is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.experts.formats.checkpoint_experts import slot_format
from engine.memory.footprint import Footprint
from engine.native.decode_shapes import ITEMSIZE
from engine.native.loaded import native
from engine.plan.survey import Survey, survey, survey_footprint
from engine.weights.model_config import resolve_device


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
    """A checkpoint described from its headers: what `plan` projects its decode speed from."""

    footprint: Footprint
    model_type: str
    expert_format: str  # e.g. "none" (float experts), "int8", "mxfp4"
    device: torch.device
    config: Any = None  # the text config (for the kernels' decode shapes)
    moe_intermediate: int = 0
    # Dense bytes a decode token streams: the dense part less an untied embedding table (only gathered).
    dense_streamed_bytes: int = 0
    # Expert-sized byte ranges as the disk tier will read them (the quantized sidecar once it exists),
    # spread over layers and experts: what `plan --hardware measured` times the disk on.
    expert_reads: tuple[ExpertRead, ...] = ()


def probe_checkpoint(model_dir: str | Path, cfg: EngineConfig) -> Probe:
    """Footprint of a checkpoint from config.json and safetensors headers only (no weights read)."""
    return probe_of(survey(model_dir, cfg, str(resolve_device(cfg.device))), cfg)


def probe_of(sv: Survey, cfg: EngineConfig) -> Probe:
    """The probe of a surveyed checkpoint (engine/plan/survey.py)."""
    ck, source = sv.ck, sv.experts
    layers, E = source.moe_layers, source.num_experts
    # Slots as the widest build this CPU runs would size them, whatever --native-kernels says (as before
    # the plan held the kernel choice: the projection's footprint, not the plan's).
    widest = native() is not None
    fmt, locator = slot_format(source, cfg, widest)
    fp = survey_footprint(sv, cfg, fmt.slot_bytes, locator.nbytes_on_disk(layers[0], 0), widest)
    tied = bool(getattr(ck.config, "tie_word_embeddings", False))
    embed = 0 if tied else fp.vocab * fp.hidden * ITEMSIZE[ck.dtype]
    if cfg.expert_quant != "none":
        from engine.experts.formats.quant_cache import (
            SidecarLocator,
            default_cache_dir,
            sidecar_path,
        )
        from engine.experts.formats.slot_layout import GroupQuantLayout
        from engine.weights.expert_layout import ExpertLocator

        assert isinstance(fmt, GroupQuantLayout) and isinstance(locator, ExpertLocator)
        path = sidecar_path(locator, fmt, layers, Path(cfg.quant_cache_dir or default_cache_dir()))
        if path.exists():
            locator = SidecarLocator(path, layers, E, fmt.slot_numel)
    return Probe(
        fp,
        str(ck.config.model_type),
        fmt.name,
        torch.device(ck.device),
        config=ck.config,
        moe_intermediate=source.shape.intermediate,
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
