"""What a model directory's config.json says, and the device and dtype the engine runs it in: read before any
weights (engine/worker/loader.py builds the model; engine/memory plans from the same reading). Devices and
dtypes are named ("cuda:0", "bfloat16"): only `resolve_device`, which asks torch for a GPU, imports it, and
a load plan, which takes its device from the Machine, never calls it (it resolves where torch is not
importable: tests/test_load_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoConfig, PretrainedConfig

from engine.errors import CheckpointError, ConfigError
from engine.weights.arch import arch_for

if TYPE_CHECKING:
    import torch

DENSE_ARCHS = ("qwen3", "qwen2", "llama", "mistral")  # drafts: loaded whole, no expert store
_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"float": "float32", "half": "float16"}  # torch's other names for the compute dtypes


def read_config(model_dir: Path) -> PretrainedConfig:
    cfg_path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found")
    if not cfg_path.exists():
        raise CheckpointError(
            f"{cfg_path}: missing (a Hugging Face model directory needs config.json)"
        )
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if str(model_type) not in DENSE_ARCHS:
        arch_for(str(model_type), str(cfg_path))  # fail early on unsupported architectures
    config = AutoConfig.from_pretrained(model_dir)
    # Training checkpoints often keep this on; at inference it only adds an aux-loss pass per step.
    config.output_router_logits = False
    return config


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} requested but no CUDA GPU is available; use --device cpu"
        )
    return dev


def device_type(device: str) -> str:
    """The type of a device's name ("cuda" of "cuda:1"), as torch.device(device).type says."""
    return device.split(":")[0]


def resolve_dtype(name: str, config: PretrainedConfig) -> str:
    """The compute dtype --dtype `name` asks for, by torch's name ("bfloat16")."""
    if name == "auto":
        # The checkpoint's own dtype on every device, as transformers' dtype="auto", llama.cpp and vLLM
        # keep it: float32 on a CPU doubled a bf16 checkpoint in memory. --dtype float32 is the exact reference.
        return checkpoint_dtype(config)
    if name not in _COMPUTE_DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return name


def checkpoint_dtype(config: PretrainedConfig) -> str:
    """The dtype config.json states (float32 where it states none, as transformers' default): a torch
    dtype or its name, torch's aliases ("half") included."""
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(d or "float32").removeprefix("torch.")
    name = _ALIASES.get(name, name)
    return name if name in _COMPUTE_DTYPES else "float32"
