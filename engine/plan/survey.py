"""What a checkpoint is, from config.json and the safetensors headers, with the model built on the meta
device (nothing is allocated, no weight is read): what a load plan is decided from
(engine/plan/resolve.py) and the model the loader then fills to it (engine/worker/loader.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.experts.formats.expert_source import CheckpointExperts
from engine.memory.footprint import Footprint, footprint
from engine.memory.measure import dense_saved
from engine.weights.arch import ArchSpec, arch_for, text_config, unsupported
from engine.weights.checkpoint import TensorLocation, index_checkpoint
from engine.weights.disk_embedding import disk_embedding_source, resident_bytes
from engine.weights.model_config import read_config, resolve_device, resolve_dtype
from engine.weights.moe_hook import MoeSite, find_moe_sites
from policies.registry import PolicyBundle


@dataclass(frozen=True)
class Checkpoint:
    """What a load reads and where it runs: found by its first step (`read_checkpoint`), read by the others."""

    model_dir: Path
    config: PretrainedConfig  # the text model's (multimodal wrappers: text_config)
    spec: ArchSpec
    tensors: dict[str, TensorLocation]
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class Survey:
    """A checkpoint surveyed: `model` on the meta device (its sparse blocks still transformers'), those
    blocks (`sites`) and their experts, the policies the settings name, and where the input embedding's
    rows are read from per step (None: it is copied into memory)."""

    ck: Checkpoint
    model: PreTrainedModel
    sites: list[MoeSite]
    experts: CheckpointExperts
    policies: PolicyBundle
    embedding: TensorLocation | None


def read_checkpoint(model_dir: Path, cfg: EngineConfig) -> tuple[Checkpoint, PolicyBundle]:
    """config.json, the architecture, the tensor index, the policies `cfg` names, and the device and
    dtype the model runs in: what fails with one line before any weight is read."""
    config = read_config(model_dir)
    spec = arch_for(config.model_type)
    # Multimodal wrappers (qwen3_5_moe, llama4): we run the text model.
    config = text_config(spec, config)
    tensors = index_checkpoint(model_dir)
    policies = cfg.policies()  # bad policy names fail here, before any weights are read
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, config, device)
    return Checkpoint(model_dir, config, spec, tensors, device, dtype), policies


def survey(model_dir: str | Path, cfg: EngineConfig) -> Survey:
    """The checkpoint at `model_dir` as `cfg` runs it: its model built on the meta device, its sparse
    MoE blocks found by structure (engine/weights/moe_hook.py) and their experts' geometry."""
    ck, policies = read_checkpoint(Path(model_dir), cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ck.config, dtype=ck.dtype)
    sites = _moe_sites(model, ck)
    experts = CheckpointExperts.of_sites(ck.spec, ck.config, ck.tensors, sites, ck.dtype, ck.device)
    # The input embedding's rows stay in the checkpoint where they can (engine/weights/disk_embedding.py).
    embedding = disk_embedding_source(
        model, ck.config, ck.spec, ck.tensors, ck.dtype, ck.device, enabled=cfg.embedding_on_disk
    )
    return Survey(ck, model, sites, experts, policies, embedding)


def _moe_sites(model: PreTrainedModel, ck: Checkpoint) -> list[MoeSite]:
    """The meta model's sparse MoE blocks, found by structure (engine/weights/moe_hook.py); fails with
    one line where there are none."""
    sites = find_moe_sites(model)
    if not sites:
        if ck.spec.by_structure:
            raise unsupported(ck.spec.model_type, str(ck.model_dir / "config.json"))
        raise CheckpointError(
            f"{ck.model_dir / 'config.json'}: no sparse MoE layers in this configuration"
        )
    return sites


def survey_footprint(sv: Survey, cfg: EngineConfig, slot_bytes: int, disk_bytes: int) -> Footprint:
    """The bytes the surveyed model needs (engine/memory/footprint.py) with experts of `slot_bytes` a
    slot and `disk_bytes` a disk read: what the memory plan is sized from."""
    ck, ex = sv.ck, sv.experts
    return footprint(
        sv.model,
        [s.block.get_submodule("experts") for s in sv.sites],
        ck.config,
        dtype=ck.dtype,
        slot_bytes=slot_bytes,
        expert_disk_bytes=disk_bytes,
        experts_per_layer=ex.num_experts,
        top_k=ex.top_k,
        moe_intermediate=ex.shape.intermediate,
        tensors=ck.tensors,
        dense_on_disk_bytes=sv.embedding.nbytes - resident_bytes(sv.embedding)
        if sv.embedding
        else 0,
        dense_saved_bytes=dense_saved(sv.model, ck.tensors, cfg, ck.device),
    )
