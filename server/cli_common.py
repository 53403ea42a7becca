"""What every model-loading command shares: engine flags (generated from EngineConfig), the
engine settings they produce, and the default model. Imported by cli.py and cli_eval.py."""
from __future__ import annotations

import argparse

from engine.config import EngineConfig
from engine.errors import MoeOffloadError
from engine.settings_file import add_flags, overrides_from_args


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--model, --config and one flag per EngineConfig setting."""
    g = p.add_argument_group("model and memory")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + *.safetensors + tokenizer). Default: the embedded model shipped in models/embedded/target")
    g.add_argument("--config", metavar="YAML", help="settings file (see configs/); flags given here override it")
    add_flags(g, EngineConfig)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    base = EngineConfig.from_yaml(args.config) if getattr(args, "config", None) else EngineConfig()
    return base.with_overrides(**overrides_from_args(args, EngineConfig))


def resolve_model_dir(arg: str | None) -> str:
    if arg:
        return arg
    from models import EMBEDDED_TARGET

    if not (EMBEDDED_TARGET / "config.json").exists():
        raise MoeOffloadError(f"{EMBEDDED_TARGET}: the embedded model is missing; pass --model DIR or run models/embedded/train.py")
    return str(EMBEDDED_TARGET)
