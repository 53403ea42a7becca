"""`moe-offload serve`: settings from --config and flags (ServerConfig, EngineConfig, SpecConfig),
checked and fitted before anything listens, then the HTTP server (server/) with its engine process."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TYPE_CHECKING

from cli.common import engine_config_from_args, resolve_model_dir, spec_choice_from_args
from engine import overrides_from_args
from server.config import ServerConfig

if TYPE_CHECKING:
    from engine import KvRequest


def _kv_request(args: argparse.Namespace, scfg: ServerConfig) -> KvRequest:
    """--max-model-len and --max-running where a flag or the --config file gives them (None where
    open: the memory plan then reserves KV for its stated defaults, not for 64 full contexts)."""
    from engine import KvRequest

    in_file: set[str] = set()
    if args.config:
        in_file = set(ServerConfig.keys_in_yaml(args.config))
    given = set(overrides_from_args(args, ServerConfig)) | in_file
    # KvRequest's fields are ServerConfig settings of the same names.
    return KvRequest(
        **{f.name: getattr(scfg, f.name) if f.name in given else None for f in fields(KvRequest)}
    )


def cmd_serve(args: argparse.Namespace) -> int:
    base = ServerConfig.from_yaml(args.config) if args.config else ServerConfig()
    scfg = base.with_overrides(**overrides_from_args(args, ServerConfig))
    # Every setting is validated here, before the engine starts and before anything listens (and
    # before the imports below, which take seconds: a bad flag fails at once).
    engine_config = engine_config_from_args(args)
    model_dir = resolve_model_dir(args.model)

    import logging
    from pathlib import Path

    from transformers import AutoTokenizer

    from engine import EngineArgs, check_model_dir, max_model_len_of
    from server.app import create_app
    from server.launch import run_server
    from server.state import ServeSettings

    check_model_dir(model_dir, need_tokenizer=True)
    from engine import machine_ahead, resolve

    kv = _kv_request(args, scfg)
    # A combination that cannot run or fit fails here, before anything listens (the engine resolves
    # its own plan again as it loads, on the machine as it is then).
    resolve(model_dir, engine_config, machine_ahead(engine_config), kv)
    spec, spec_why = spec_choice_from_args(args, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    limits = scfg.core_limits(max_model_len_of(model_dir, scfg.max_model_len))
    engine = EngineArgs(
        model_dir, engine_config, limits, spec=spec, spec_why=spec_why, kv_request=kv
    )
    name = scfg.served_model_name or Path(model_dir).resolve().name
    settings = ServeSettings(engine, name, scfg)
    logging.basicConfig(
        level=scfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_server(
        create_app(settings, tokenizer), scfg.host, scfg.port, scfg.drain_timeout, scfg.log_level
    )
