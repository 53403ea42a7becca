"""What every model-loading command shares: engine flags (generated from EngineConfig), the
engine settings they produce, and the default model. Imported by every command module here."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine import (
    CheckpointError,
    EngineConfig,
    MoeOffloadError,
    SpecConfig,
    add_flags,
    overrides_from_args,
)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--model, --config and one flag per EngineConfig setting."""
    g = p.add_argument_group("model and memory")
    g.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face model directory (config.json + *.safetensors + tokenizer). Default: the embedded model shipped in models/embedded/target",
    )
    g.add_argument(
        "--config",
        metavar="YAML",
        help="settings file (see configs/); flags given here override it",
    )
    add_flags(g, EngineConfig)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    base = EngineConfig.from_yaml(args.config) if getattr(args, "config", None) else EngineConfig()
    return base.with_overrides(**overrides_from_args(args, EngineConfig))


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("speculative decoding"), SpecConfig)


def spec_config_from_args(args: argparse.Namespace, model_dir: str) -> SpecConfig:
    """The speculation settings, resolved against the model and the device (SpecConfig.choose), with the
    draft checked against the target's vocabulary: one line on any problem."""
    return spec_choice_from_args(args, model_dir)[0]


def spec_choice_from_args(args: argparse.Namespace, model_dir: str) -> tuple[SpecConfig, str]:
    """spec_config_from_args and why that mode, for the plan's log line."""
    from engine import check_draft

    base = SpecConfig.from_yaml(args.config) if getattr(args, "config", None) else SpecConfig()
    device = engine_config_from_args(args).device
    device_type = (
        ("cuda" if torch_cuda_available() else "cpu") if device == "auto" else device.split(":")[0]
    )
    spec, why = base.with_overrides(**overrides_from_args(args, SpecConfig)).choose(
        model_dir, device_type
    )
    if spec.draft is not None:
        check_draft(model_dir, spec.draft)
    return spec, why


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_model_dir(arg: str | None) -> str:
    """--model, or the embedded model where it is not given. A directory that does not exist fails
    here, before the seconds of imports that reading a checkpoint needs."""
    if arg:
        if not Path(arg).is_dir():
            raise CheckpointError(f"{arg}: model directory not found")
        return arg
    from models import EMBEDDED_TARGET

    if not (EMBEDDED_TARGET / "config.json").exists():
        raise MoeOffloadError(
            f"{EMBEDDED_TARGET}: the embedded model is missing; pass --model DIR or run `python -m models.embedded.train`"
        )
    return str(EMBEDDED_TARGET)
