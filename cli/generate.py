"""`moe-offload generate`: one prompt through the same engine core as the server, in this process."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cli.common import engine_config_from_args, resolve_model_dir, spec_choice_from_args
from engine import MoeOffloadError, SamplingParams, overrides_from_args, setting

if TYPE_CHECKING:
    from engine import GenerateRequest, OffloadedModel


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


@dataclass
class Generated:
    """What one generation produced, gathered while it streamed."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish: str | None = None
    t0: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0


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
    from engine import (
        CoreLimits,
        EngineCore,
        GenerateRequest,
        KvRequest,
        load_model,
        make_speculation,
        max_model_len_of,
    )

    spec, spec_why = spec_choice_from_args(args, model_dir)
    max_len = max_model_len_of(model_dir, opts.max_model_len)
    om = load_model(model_dir, ecfg, KvRequest(opts.max_model_len, max_running=1))
    plan = om.load_plan.with_speculation(spec.speculative, spec_why)
    print(plan.describe(), file=sys.stderr, flush=True)  # the start-up line: serve logs the same
    try:
        ids = _prompt_ids(om, opts, max_len)
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
        out = _stream(core, req, echo=not opts.json)
        if opts.json:
            print(json.dumps(_report(out, ids, opts, om, plan.execution.to_dict()), indent=2))
        else:
            print()
    finally:
        om.close()
    return 0


def _prompt_ids(om: OffloadedModel, opts: GenerateOptions, max_len: int) -> list[int]:
    """The prompt's token ids (through the chat template with --chat); fails where it fills the context."""
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
    return ids


def _stream(core: Any, req: GenerateRequest, echo: bool) -> Generated:
    """Run one request to its end; with `echo`, write each piece of text as it comes."""
    out = Generated(t0=time.perf_counter())
    for step in core.generate([req]):
        if step.token_ids and out.t_first is None:
            out.t_first = time.perf_counter()
        out.text += step.text
        out.tokens += step.token_ids
        out.logprobs += step.logprobs or []
        out.finish = step.finish_reason or out.finish
        if step.error:
            raise MoeOffloadError(f"generation failed: {step.error}")
        if echo:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    out.t_end = time.perf_counter()
    return out


def _report(
    out: Generated, ids: list[int], opts: GenerateOptions, om: OffloadedModel, plan: dict[str, Any]
) -> dict[str, Any]:
    """--json's object: text, tokens, timings, the plan and the engine's statistics."""
    first = out.t_first or out.t_end
    decode_s = out.t_end - first
    return {
        "text": out.text,
        "tokens": out.tokens,
        "prompt_tokens": len(ids),
        "finish_reason": out.finish,
        "logprobs": [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in out.logprobs
        ]
        if opts.logprobs is not None
        else None,
        "prefill_seconds": first - out.t0,
        "decode_seconds": decode_s,
        # The first token comes from prefill; decode speed counts the tokens after it.
        "decode_tokens_per_s": (len(out.tokens) - 1) / decode_s
        if len(out.tokens) > 1 and decode_s > 0
        else 0.0,
        "fast_tier_slots": om.store.n_slots,
        "plan": plan,
        "stats": om.stats.snapshot(),
    }
