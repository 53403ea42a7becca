"""What a model directory's config.json says, and the device and dtype the engine runs it in: read before any
weights (engine/worker/loader.py builds the model; engine/memory plans from the same reading). torch is
imported by the functions that return its objects: config.json is read without it (a load plan's header
survey, engine/weights/header_survey.py, runs where torch is not importable: tests/test_load_plan.py)."""

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


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        # The checkpoint's own dtype on every device, as transformers' dtype="auto", llama.cpp and vLLM
        # keep it: float32 on a CPU doubled a bf16 checkpoint in memory. --dtype float32 is the exact reference.
        return checkpoint_dtype(config)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16"
        ) from None


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype config.json states (float32 where it states none, as transformers' default)."""
    import torch

    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    d = (
        d
        if isinstance(d, torch.dtype)
        else getattr(torch, str(d or "float32").removeprefix("torch."), None)
    )
    return d if d in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
