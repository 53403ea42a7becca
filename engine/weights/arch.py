"""Which architectures we run, and how their tensors are named on disk.

In transformers 5 every supported family has one in-memory shape: a sparse block holding a
router and an `experts` module with fused 3-D parameters (see engine/weights/moe_hook.py,
which finds those blocks by structure). What differs per family, and what this table
records, is what transformers' checkpoint conversion (transformers/conversion_mapping.py)
would otherwise hide from us, because we read the safetensors files ourselves:
- the name of the block on disk (`mlp`, `block_sparse_moe`, `feed_forward`);
- the per-expert projection names, or the fused tensor names;
- dense weights renamed between disk and memory (a router called `gate` on disk, ...);
- multimodal wrappers whose text model sits under another prefix on disk;
- the expert kernel (engine/experts/formats/expert_kernels.py).
The on-disk names of real checkpoints come from their published model.safetensors.index.json
files; tests/test_architectures.py builds tiny checkpoints with those names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from engine.errors import CheckpointError

_SWIGLU = ("gate_proj", "up_proj", "down_proj")
_W13_2 = ("w1", "w3", "w2")  # Mixtral-style names: w1 = gate, w3 = up, w2 = down


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    disk_block: str = "mlp"  # name of the sparse block under model.layers.{l} in checkpoint files
    gate_up_down: tuple[str, ...] = (
        _SWIGLU  # per-expert projection names on disk ("" = no per-expert layout)
    )
    fused: tuple[str, ...] = (
        "experts.gate_up_proj",
        "experts.down_proj",
    )  # fused tensors under the block, kernel order
    kernel: str = "swiglu"  # swiglu | gpt_oss | llama4
    renames: tuple[
        tuple[str, str], ...
    ] = ()  # (in-memory fragment, on-disk fragment) for dense weights
    prefixes: tuple[
        tuple[str, str], ...
    ] = ()  # (in-memory prefix, on-disk prefix): wrappers tried before the plain name
    text_config: bool = (
        False  # config.json describes a multimodal wrapper; we run config.text_config
    )
    by_structure: bool = (
        False  # not in the table: run because its blocks match the structure, checked at load
    )


# Qwen3.5 and 3.6 checkpoints are multimodal (model_type qwen3_5_moe) and keep the text model under
# model.language_model.*; transformers' text-only save writes model.*. Both load.
_QWEN35_PREFIX = (("model.", "model.language_model."),)
# Llama 4 checkpoints (Scout, Maverick) keep the text model under language_model.*.
_LLAMA4_PREFIX = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
_LLAMA4: dict[str, Any] = dict(disk_block="feed_forward", gate_up_down=(), kernel="llama4")

ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": ArchSpec("qwen3_moe"),
    "qwen2_moe": ArchSpec("qwen2_moe"),
    "olmoe": ArchSpec("olmoe"),
    "mixtral": ArchSpec("mixtral", "block_sparse_moe", _W13_2),
    "qwen3_next": ArchSpec("qwen3_next"),
    "qwen3_5_moe_text": ArchSpec("qwen3_5_moe_text", prefixes=_QWEN35_PREFIX),
    "qwen3_5_moe": ArchSpec("qwen3_5_moe", prefixes=_QWEN35_PREFIX, text_config=True),
    "deepseek_v3": ArchSpec("deepseek_v3"),
    "glm4_moe": ArchSpec("glm4_moe"),
    "ernie4_5_moe": ArchSpec(
        "ernie4_5_moe", renames=((".mlp.gate.moe_statics.", ".mlp.moe_statics."),)
    ),
    "minimax_m2": ArchSpec("minimax_m2", "block_sparse_moe", _W13_2),
    "phimoe": ArchSpec(
        "phimoe",
        "block_sparse_moe",
        _W13_2,
        renames=((".block_sparse_moe.router.", ".block_sparse_moe.gate."),),
    ),
    "granitemoe": ArchSpec(
        "granitemoe",
        "block_sparse_moe",
        (),
        ("input_linear.weight", "output_linear.weight"),
        renames=((".router.weight", ".router.layer.weight"),),
    ),
    "gpt_oss": ArchSpec(
        "gpt_oss",
        gate_up_down=(),
        kernel="gpt_oss",
        fused=(
            "experts.gate_up_proj",
            "experts.gate_up_proj_bias",
            "experts.down_proj",
            "experts.down_proj_bias",
        ),
    ),
    "llama4_text": ArchSpec("llama4_text", prefixes=_LLAMA4_PREFIX, **_LLAMA4),
    "llama4": ArchSpec("llama4", prefixes=_LLAMA4_PREFIX, text_config=True, **_LLAMA4),
}


def arch_for(model_type: str, config_path: str = "config.json") -> ArchSpec:
    """The table's entry, or for a model_type not in it (hunyuan_v1_moe, dots1, ...) the generic one:
    transformers' own names on disk, SwiGLU experts. Such a model runs when its sparse blocks match
    the structure (engine/weights/moe_hook.py), each checked at load against its own forward."""
    if not model_type or model_type == "None":
        raise CheckpointError(
            f"{config_path}: no model_type; a Hugging Face config.json names its architecture"
        )
    return ARCHS.get(model_type) or ArchSpec(model_type, by_structure=True)


def text_config(spec: ArchSpec, config: PretrainedConfig) -> PretrainedConfig:
    """The config of the model we build: the text model of a multimodal wrapper, else `config`."""
    if spec.text_config:
        config = config.get_text_config()
        config.output_router_logits = False
    return config


def disk_names(spec: ArchSpec, memory_name: str) -> list[str]:
    """Checkpoint names an in-memory parameter may have, most likely first.

    Mixtral checkpoints call the block `block_sparse_moe`; ones saved from transformers 5's
    in-memory layout (fused experts) keep `mlp`.
    """
    names = [memory_name]
    if spec.disk_block != "mlp" and ".mlp." in memory_name:
        names.insert(0, memory_name.replace(".mlp.", f".{spec.disk_block}."))
    for mem, disk in spec.renames:
        names = [n.replace(mem, disk) for n in names if mem in n] + names
    for mem, disk in spec.prefixes:
        names = [disk + n[len(mem) :] for n in names if n.startswith(mem)] + names
    return list(dict.fromkeys(names))


def unsupported(model_type: str, config_path: str) -> CheckpointError:
    """The error for a model_type outside the table whose blocks do not match the structure."""
    return CheckpointError(
        f"{config_path}: unsupported architecture model_type={model_type!r}: no sparse MoE block matches the structure "
        f"(an `experts` module with fused 3-D weights beside a router whose weight is [num_experts, hidden]); "
        f"known by name: {', '.join(sorted(ARCHS))}"
    )
