"""Which architectures we run, and how their expert tensors are named on disk.

All four supported families share one in-memory shape in transformers 5: a sparse
block with a `gate` router returning (logits, top-k weights, top-k ids) and an
`experts` module with fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I].
They differ only in the on-disk names, which this table records.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import CheckpointError


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    disk_block: str  # name of the sparse block under model.layers.{l} in checkpoint files
    gate_up_down: tuple[str, str, str]  # per-expert projection names on disk


ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": ArchSpec("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ArchSpec("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ArchSpec("olmoe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ArchSpec("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
}


def arch_for(model_type: str, config_path: str = "config.json") -> ArchSpec:
    if model_type not in ARCHS:
        raise CheckpointError(
            f"{config_path}: unsupported architecture model_type={model_type!r}; supported: {', '.join(sorted(ARCHS))}"
        )
    return ARCHS[model_type]


def disk_names(spec: ArchSpec, memory_name: str) -> list[str]:
    """Checkpoint names an in-memory parameter may have, most likely first.

    Mixtral checkpoints call the block `block_sparse_moe`; ones saved from transformers 5's
    in-memory layout (fused experts) keep `mlp`.
    """
    names = [memory_name]
    if spec.disk_block != "mlp" and ".mlp." in memory_name:
        names.insert(0, memory_name.replace(".mlp.", f".{spec.disk_block}."))
    return names
