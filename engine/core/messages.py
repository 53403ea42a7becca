"""Typed messages between the front end and the engine process (plain data, picklable).

In: GenerateRequest, AbortRequest, Shutdown.  Out: EngineReady, RequestOutput, StatsUpdate,
EngineDead.  Nothing here holds tensors or locks, so every message crosses a spawn boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.structured.spec import ConstraintSpec


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's logprob plus top-k
    prompt_logprobs: int | None = None  # same, for every prompt position (completions echo)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    constraint: ConstraintSpec | None = None  # structured output: the grammar the output must match


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    """Abort everything, free the model and exit; the front end sends it, never a signal."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request since its previous output (token ids and the text they add)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, with the first output
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, exact (a terminating EOS is not counted)
    queue_seconds: float | None = None  # set on the first output: arrival -> first scheduled
    # lm_eval exactness (issue 14): the logprob of the EOS token that ended the sequence, when
    # logprobs were asked for; EOS stays out of token_ids, text and usage, but the completions
    # API lists it in `logprobs` as vLLM does.
    eos_logprob: TokenLogprob | None = None
    stop_sequence: str | None = None  # on a "stop" finish caused by a stop string: which one
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of prefilled


@dataclass(frozen=True)
class StatsUpdate:
    num_running: int
    num_waiting: int
    engine: dict[str, Any]  # EngineStats.snapshot()


@dataclass(frozen=True)
class EngineReady:
    model_dir: str
    max_model_len: int
    pid: int
    plan: tuple[
        str, ...
    ] = ()  # the load plan's text, a line each (engine/plan/load_plan.py LoadPlan.lines)


@dataclass(frozen=True)
class EngineDead:
    error: str


EngineInput = GenerateRequest | AbortRequest | Shutdown
EngineOutput = EngineReady | RequestOutput | StatsUpdate | EngineDead
