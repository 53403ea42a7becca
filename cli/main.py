"""The `moe-offload` command line's parser and entry point. Each command lives in its own module:
serve.py, generate.py, eval.py (eval, trace; simulate.py), plan.py and prefetch.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cli.common import add_engine_flags, add_spec_flags
from cli.eval import add_eval_parsers
from cli.generate import GenerateOptions, cmd_generate
from cli.plan import add_plan_parser
from cli.prefetch import add_prefetch_parser
from cli.serve import cmd_serve
from engine import MoeOffloadError, SamplingParams, add_flags
from server.config import ServerConfig


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
