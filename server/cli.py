"""The `moe-offload` command line: serve, generate, (cli_eval.py) eval, trace, simulate, and (cli_prefetch.py) train-prefetcher."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams
from engine.errors import MoeOffloadError
from engine.settings_file import add_flags, overrides_from_args, setting
from server.cli_common import (
    add_engine_flags,
    add_spec_flags,
    engine_config_from_args,
    resolve_model_dir,
    spec_choice_from_args,
)
from server.cli_eval import add_eval_parsers
from server.cli_plan import add_plan_parser
from server.cli_prefetch import add_prefetch_parser
from server.config import ServerConfig

if TYPE_CHECKING:
    from engine.memory.planner import KvRequest


@dataclass(frozen=True)
class GenerateOptions:
    """`generate` flags beyond sampling (those come from SamplingParams)."""

    prompt: str = setting("", "the prompt text (required)")
    chat: bool = setting(
        False, "wrap the prompt as a user message with the tokenizer's chat template"
    )
    presence_penalty: float = setting(
        0.0, "OpenAI presence penalty in [-2, 2] (default 0)", metavar="X"
    )
    frequency_penalty: float = setting(
        0.0, "OpenAI frequency penalty in [-2, 2] (default 0)", metavar="X"
    )
    logprobs: int | None = setting(
        None,
        "report each token's logprob and the N most likely alternatives (with --json)",
        metavar="N",
    )
    max_model_len: int | None = setting(
        None,
        "context length: generation ends ('length') when prompt + output reach it (default: the model's max_position_embeddings)",
        metavar="N",
    )
    json: bool = setting(
        False,
        "print one JSON object: text, tokens, finish reason, timings and statistics (hits, misses, bytes moved, stall seconds, per layer)",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    opts = GenerateOptions(**overrides_from_args(args, GenerateOptions))
    if not opts.prompt:
        raise MoeOffloadError("--prompt is required, e.g. --prompt 'Hello'")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(opts, name) <= 2.0:
            raise MoeOffloadError(f"--{name.replace('_', '-')} must be in [-2, 2]")
    params = SamplingParams(**overrides_from_args(args, SamplingParams))
    model_dir = resolve_model_dir(args.model)
    ecfg = engine_config_from_args(args)
    # After the checks above, which fail in a blink: these imports take seconds.
    from engine.core.engine_core import CoreLimits, EngineCore
    from engine.core.messages import GenerateRequest
    from engine.launch import max_model_len_of
    from engine.memory.planner import KvRequest
    from engine.worker.loader import load_model

    spec, spec_why = spec_choice_from_args(args, model_dir)
    max_len = max_model_len_of(model_dir, opts.max_model_len)
    om = load_model(model_dir, ecfg, KvRequest(opts.max_model_len, max_running=1))
    plan = om.plan.with_speculation(spec.speculative, spec_why)
    print("engine plan:\n  " + "\n  ".join(plan.lines()), file=sys.stderr, flush=True)
    try:
        if om.tokenizer is None:
            raise MoeOffloadError(
                f"{om.model_dir}: no tokenizer files; add tokenizer.json/tokenizer_config.json"
            )
        if opts.chat:
            ids = om.tokenizer.apply_chat_template(
                [{"role": "user", "content": opts.prompt}],
                add_generation_prompt=True,
                tokenize=True,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = list(om.tokenizer(opts.prompt)["input_ids"])
        if len(ids) >= max_len:
            raise MoeOffloadError(
                f"the prompt has {len(ids)} tokens but the context is {max_len}; shorten it or raise --max-model-len"
            )
        from engine.speculative.factory import make_speculation

        proposer, observers = make_speculation(spec, om)
        core = EngineCore.for_model(
            om, CoreLimits(max_running=1, max_model_len=max_len), proposer, observers
        )
        req = GenerateRequest(
            "generate",
            ids,
            params,
            opts.logprobs,
            None,
            opts.presence_penalty,
            opts.frequency_penalty,
        )
        text, tokens, logprobs, finish = "", [], [], None
        t0 = time.perf_counter()
        t_first: float | None = None
        for out in core.generate([req]):
            if out.token_ids and t_first is None:
                t_first = time.perf_counter()
            text += out.text
            tokens += out.token_ids
            logprobs += out.logprobs or []
            finish = out.finish_reason or finish
            if out.error:
                raise MoeOffloadError(f"generation failed: {out.error}")
            if not opts.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
        t_end = time.perf_counter()
        if opts.json:
            decode_s = t_end - (t_first or t_end)
            print(
                json.dumps(
                    {
                        "text": text,
                        "tokens": tokens,
                        "prompt_tokens": len(ids),
                        "finish_reason": finish,
                        "logprobs": [
                            {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
                            for lp in logprobs
                        ]
                        if opts.logprobs is not None
                        else None,
                        "prefill_seconds": (t_first or t_end) - t0,
                        "decode_seconds": decode_s,
                        # The first token comes from prefill; decode speed counts the tokens after it.
                        "decode_tokens_per_s": (len(tokens) - 1) / decode_s
                        if len(tokens) > 1 and decode_s > 0
                        else 0.0,
                        "fast_tier_slots": om.store.n_slots,
                        "plan": plan.to_dict(),
                        "stats": om.stats.snapshot(),
                    },
                    indent=2,
                )
            )
        else:
            print()
    finally:
        om.close()
    return 0


def _kv_request(args: argparse.Namespace, scfg: ServerConfig) -> KvRequest:
    """--max-model-len and --max-running where a flag or the --config file gives them (None where
    open: the memory plan then reserves KV for its stated defaults, not for 64 full contexts)."""
    from engine.memory.planner import KvRequest

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

    from engine.launch import EngineArgs, max_model_len_of
    from engine.worker.loader import check_model_dir
    from server.app import create_app
    from server.launch import run_server
    from server.state import ServeSettings

    check_model_dir(model_dir, need_tokenizer=True)
    from engine.memory.measure import plan_checkpoint

    kv = _kv_request(args, scfg)
    # A combination that cannot fit fails here, before anything listens.
    plan_checkpoint(model_dir, engine_config, kv)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-offload",
        description="Run Mixture-of-Experts models whose experts do not fit in fast memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, /tokenize, /health, /metrics). "
        "Settings come from --config YAML (sections engine: and server:), overridden by these flags.",
    )
    add_flags(s.add_argument_group("server"), ServerConfig)
    add_engine_flags(s)
    add_spec_flags(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt with offloaded experts, through the same engine core as the server.",
    )
    add_flags(g.add_argument_group("prompt and output"), GenerateOptions)
    add_flags(g.add_argument_group("sampling"), SamplingParams)
    add_engine_flags(g)
    add_spec_flags(g)
    g.set_defaults(func=cmd_generate)

    add_eval_parsers(sub)
    add_prefetch_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (MoeOffloadError, ValueError) as e:
        print(f"moe-offload: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
