"""The `moe-offload` command line: serve, generate (and, as they land, eval, trace, bench)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from engine.errors import MoeOffloadError


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model."""
    g = p.add_argument_group("model and memory")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + *.safetensors + tokenizer). Default: the embedded model shipped in models/embedded/target")
    g.add_argument("--config", metavar="YAML", help="engine settings file (see configs/); flags given here override it")
    g.add_argument("--cache-fraction", type=float, metavar="F", help="share of all routed experts kept in the fast tier, in (0, 1]. Default 1.0")
    g.add_argument("--cache-bytes", type=int, metavar="N", help="fast-tier budget in bytes (overrides --cache-fraction)")
    g.add_argument("--offload", choices=["ram", "disk"], help="slow tier: 'ram' keeps all experts in host memory; 'disk' reads them from the checkpoint with uncached I/O. Default ram")
    g.add_argument("--link", metavar="NAME|MBPS[:US]", help="emulate a slower link in front of the slow tier: a name (pcie4, pcie3, nvme, sata-ssd, ufs, usb3, sdcard, hdd) or bandwidth in MB/s with optional latency in µs, e.g. 200:500")
    g.add_argument("--policy", metavar="NAME", help="miss policy: fetch-all (default; waits for every missing expert, exact), threshold (wait for the first choice or a normalized gate >= --threshold, substitute the rest), first-choice (wait only for the first choice), threshold-noprotect (threshold without first-choice protection, a contrast baseline), or a preset: quality-first (threshold + frequency eviction + background admission) or speed-first (first-choice + the same)")
    g.add_argument("--eviction", metavar="NAME", help="eviction policy: lru or frequency (decayed LFU). Default: frequency for the presets, else lru")
    g.add_argument("--admission", metavar="NAME", help="admission policy: none, or background (load an expert asynchronously once its substituted gate mass adds up to --admission-beta). Default: background for the presets, else none")
    g.add_argument("--substitute", metavar="NAME", help="what stands in for a substituted miss: best-resident (default; highest-logit resident expert takes its gate weight) or drop (renormalize the remaining gates)")
    g.add_argument("--threshold", type=float, metavar="G", help="gate cut-off of the threshold rule (default 0.15)")
    g.add_argument("--admission-beta", type=float, metavar="B", help="substituted mass that triggers background admission (default 0.5)")
    g.add_argument("--device", metavar="DEV", help="compute device: auto (default), cpu, cuda, cuda:N")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="compute dtype (auto: float32 on CPU, checkpoint dtype on GPU)")
    g.add_argument("--transfer-workers", type=int, metavar="N", help="background transfer threads (default 2)")
    g.add_argument("--no-warm", action="store_true", help="start with an empty fast tier instead of filling it at load time")


def engine_config_from_args(args: argparse.Namespace):
    from engine.config import EngineConfig

    base = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    return base.with_overrides(
        cache_fraction=args.cache_fraction,
        cache_bytes=args.cache_bytes,
        offload=args.offload,
        link=args.link,
        policy=args.policy,
        eviction=args.eviction,
        admission=args.admission,
        substitute=args.substitute,
        threshold=args.threshold,
        admission_beta=args.admission_beta,
        device=args.device,
        dtype=args.dtype,
        transfer_workers=args.transfer_workers,
        warm_start=False if args.no_warm else None,
    )


def resolve_model_dir(arg: str | None) -> str:
    if arg:
        return arg
    from models import EMBEDDED_TARGET

    if not (EMBEDDED_TARGET / "config.json").exists():
        raise MoeOffloadError(f"{EMBEDDED_TARGET}: the embedded model is missing; pass --model DIR or run models/embedded/train.py")
    return str(EMBEDDED_TARGET)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.generation import stream_generate
    from engine.worker.loader import load_model
    from engine.worker.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    om = load_model(resolve_model_dir(args.model), engine_config_from_args(args))
    try:
        if om.tokenizer is None:
            raise MoeOffloadError(f"{om.model_dir}: no tokenizer files; add tokenizer.json/tokenizer_config.json")
        if args.chat:
            ids = om.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = om.tokenizer(args.prompt)["input_ids"]
        printed = 0
        res = None
        for res in stream_generate(om, ids, params):
            if not args.json:
                sys.stdout.write(res.text[printed:])
                sys.stdout.flush()
                printed = len(res.text)
        assert res is not None
        if args.json:
            stats = om.stats.snapshot()
            print(json.dumps({
                "text": res.text,
                "tokens": res.tokens,
                "prompt_tokens": res.prompt_tokens,
                "finish_reason": res.finish_reason,
                "prefill_seconds": res.prefill_seconds,
                "decode_seconds": res.decode_seconds,
                "decode_tokens_per_s": res.decode_tokens_per_s,
                "fast_tier_slots": om.store.n_slots,
                "stats": stats,
            }, indent=2))
        else:
            print()
    finally:
        om.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from transformers import AutoTokenizer

    from engine.core.engine_process import EngineArgs, max_model_len_of
    from server.app import create_app
    from server.config import ServerConfig
    from server.launch import run_server
    from server.state import ServeSettings

    base = ServerConfig.from_yaml(args.config) if args.config else ServerConfig()
    scfg = base.with_overrides(
        host=args.host, port=args.port, api_keys=tuple(args.api_key) if args.api_key else None,
        served_model_name=args.served_model_name, max_running=args.max_running, max_queue=args.max_queue,
        max_model_len=args.max_model_len, drain_timeout=args.drain_timeout, log_level=args.log_level,
        max_body_bytes=args.max_body_bytes, engine_restarts=args.engine_restarts,
    )
    from engine.worker.loader import check_model_dir

    model_dir = resolve_model_dir(args.model)
    check_model_dir(model_dir, need_tokenizer=True)  # one-line errors before the engine process starts
    if args.draft and not (Path(args.draft) / "config.json").exists():
        raise MoeOffloadError(f"{args.draft}: not a model directory (no config.json)")
    engine_config = engine_config_from_args(args)
    engine_config.policies()  # unknown policy names: one line now, not an engine crash later
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EngineArgs(
        model_dir=model_dir, engine_config=engine_config, max_model_len=max_model_len_of(model_dir, scfg.max_model_len),
        max_running=scfg.max_running, prefill_token_budget=scfg.prefill_token_budget, draft_dir=args.draft,
    )
    settings = ServeSettings(
        engine, scfg.served_model_name or Path(model_dir).resolve().name, scfg.api_keys, scfg.max_queue, scfg.drain_timeout,
        scfg.max_body_bytes, scfg.max_messages, scfg.max_prompts, scfg.max_request_tokens, scfg.engine_restarts, scfg.engine_restart_window,
    )
    logging.basicConfig(level=scfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_server(create_app(settings, tokenizer), scfg.host, scfg.port, scfg.drain_timeout, scfg.log_level)


def add_serve_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    s = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics). "
        "Settings come from --config YAML (sections engine: and server:), overridden by these flags.",
    )
    g = s.add_argument_group("server")
    g.add_argument("--host", metavar="ADDR", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, metavar="N", help="TCP port (default 8000)")
    g.add_argument("--api-key", action="append", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/* (repeatable: any listed key is accepted); /health and /metrics stay public")
    g.add_argument("--served-model-name", metavar="NAME", help="model id clients must send and /v1/models lists (default: the model directory's name)")
    g.add_argument("--draft", metavar="DIR", help="draft model directory for speculative decoding (accepted and checked; speculation is not active yet)")
    g.add_argument("--max-running", type=int, metavar="N", help="sequences decoded together in one engine step (default 64)")
    g.add_argument("--max-queue", type=int, metavar="N", help="sequences allowed to wait beyond --max-running; more get 503 with Retry-After (default 256)")
    g.add_argument("--max-model-len", type=int, metavar="N", help="context length: prompt + max_tokens must fit (default: the model's max_position_embeddings)")
    g.add_argument("--drain-timeout", type=float, metavar="S", help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish before they are aborted (default 30)")
    g.add_argument("--max-body-bytes", type=int, metavar="N", help="request bodies larger than this get 413 before they are read (default 8 MiB)")
    g.add_argument("--engine-restarts", type=int, metavar="N", help="restarts of a dead engine allowed within 10 minutes; then the server exits 1 for its supervisor (default 3)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log verbosity (default info)")
    add_engine_flags(s)
    s.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-offload", description="Run Mixture-of-Experts models whose experts do not fit in fast memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)

    g = sub.add_parser("generate", help="generate text for one prompt", description="Generate text for one prompt with offloaded experts.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="maximum new tokens (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, metavar="S", help="random seed for sampling (reproducible output)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop when this text appears (repeatable); it is not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, tokens and statistics (hits, misses, bytes moved, stall seconds, tokens/s, per layer)")
    add_engine_flags(g)
    g.set_defaults(func=cmd_generate)

    from server.cli_eval import add_eval_parsers

    add_eval_parsers(sub)
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
