"""What a checkpoint is, from config.json and the safetensors headers alone: no model is built, not even
on the meta device, and no weight is read (engine/weights/header_survey.py). What a load plan is decided
from (engine/plan/resolve.py); the loader then builds the model and checks it against this survey
(engine/worker/built.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from engine.config import EngineConfig
from engine.experts.formats.checkpoint_experts import CheckpointExperts
from engine.memory.footprint import Footprint, dense_saved, footprint
from engine.weights.arch import ArchSpec, arch_for, text_config
from engine.weights.embedding_source import disk_embedding_source, resident_bytes
from engine.weights.header_survey import HeaderSurvey, header_survey
from engine.weights.model_config import read_config, resolve_dtype
from engine.weights.safetensors_index import TensorLocation, index_checkpoint
from policies.registry import PolicyBundle


@dataclass(frozen=True)
class Checkpoint:
    """What a load reads and where it runs: found by its first step (`read_checkpoint`), read by the others."""

    model_dir: Path
    config: PretrainedConfig  # the text model's (multimodal wrappers: text_config)
    spec: ArchSpec
    tensors: dict[str, TensorLocation]
    device: str  # "cpu", "cuda", "cuda:N": the Machine's (engine/memory/machine.py)
    dtype: str  # torch's name for the compute dtype ("bfloat16")


@dataclass(frozen=True)
class Survey:
    """A checkpoint surveyed from its headers: its MoE layers, dense parameters and structure (`layout`),
    its experts, the policies the settings name, and where the input embedding's rows are read from per
    step (None: it is copied into memory)."""

    ck: Checkpoint
    layout: HeaderSurvey
    experts: CheckpointExperts
    policies: PolicyBundle
    embedding: TensorLocation | None


def read_checkpoint(
    model_dir: Path, cfg: EngineConfig, device: str
) -> tuple[Checkpoint, PolicyBundle]:
    """config.json, the architecture, the tensor index, the policies `cfg` names, and the dtype the model
    runs in on `device`: what fails with one line before any weight is read."""
    config = read_config(model_dir)
    spec = arch_for(config.model_type)
    # Multimodal wrappers (qwen3_5_moe, llama4): we run the text model.
    config = text_config(spec, config)
    tensors = index_checkpoint(model_dir)
    policies = cfg.policies()  # bad policy names fail here, before any weights are read
    dtype = resolve_dtype(cfg.dtype, config)
    return Checkpoint(model_dir, config, spec, tensors, device, dtype), policies


def survey(model_dir: str | Path, cfg: EngineConfig, device: str) -> Survey:
    """The checkpoint at `model_dir` as `cfg` runs it on `device` (the Machine's: "cpu", "cuda:0"), from
    its headers: its sparse MoE layers, their experts' geometry, its dense parameters
    (engine/weights/header_survey.py)."""
    ck, policies = read_checkpoint(Path(model_dir), cfg, device)
    layout = header_survey(ck.spec, ck.config, ck.tensors, str(ck.model_dir / "config.json"))
    experts = CheckpointExperts.of_header(
        ck.spec, ck.config, ck.tensors, layout, ck.dtype, ck.device
    )
    # The input embedding's rows stay in the checkpoint where they can (engine/weights/disk_embedding.py).
    embedding = disk_embedding_source(
        layout.embedding,
        ck.config,
        ck.spec,
        ck.tensors,
        ck.dtype,
        ck.device,
        enabled=cfg.embedding_on_disk,
    )
    return Survey(ck, layout, experts, policies, embedding)


def survey_footprint(
    sv: Survey, cfg: EngineConfig, slot_bytes: int, disk_bytes: int, native: bool
) -> Footprint:
    """The bytes the surveyed model needs (engine/memory/footprint.py) with experts of `slot_bytes` a
    slot and `disk_bytes` a disk read, where the native kernels run or not (`native`): what the memory
    plan is sized from."""
    ck, ex, layout = sv.ck, sv.experts, sv.layout
    return footprint(
        layout.dense_params,
        len(layout.moe_layers),
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
        dense_saved_bytes=dense_saved(
            layout.dense_linears, ck.tensors, cfg, ck.device, ck.dtype, native
        ),
    )
