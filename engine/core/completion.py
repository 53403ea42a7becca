"""Run requests to completion in-process through the engine core (CLI, benchmarks, tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest, TokenLogprob
from engine.core.sampling_params import SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(
        default_factory=list
    )  # asked for: position 0 is None
    t_submit: float = 0.0
    t_first: float | None = None  # first output token arrived
    t_end: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.token_ids

    @property
    def prefill_seconds(self) -> float:
        return (self.t_first if self.t_first is not None else self.t_end) - self.t_submit

    @property
    def decode_seconds(self) -> float:
        return self.t_end - (self.t_first if self.t_first is not None else self.t_end)

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from prefill; decode speed counts the tokens after it.
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def complete(core: EngineCore, reqs: list[GenerateRequest]) -> list[Completion]:
    """Submit all requests at once (they share steps) and return their completions in order."""
    now = time.perf_counter()
    done = {r.request_id: Completion(r.request_id, len(r.prompt_ids), t_submit=now) for r in reqs}
    for out in core.generate(reqs):
        c = done[out.request_id]
        t = time.perf_counter()
        if out.token_ids and c.t_first is None:
            c.t_first = t
        c.token_ids += out.token_ids
        c.text += out.text
        c.logprobs += out.logprobs or []
        c.prompt_logprobs += out.prompt_logprobs or []
        if out.finish_reason is not None:
            c.finish_reason, c.error, c.t_end = out.finish_reason, out.error, t
    return [done[r.request_id] for r in reqs]


def generate(
    lm: Any, prompt_ids: list[int], params: SamplingParams, max_model_len: int = 1 << 20, **kw: Any
) -> Completion:
    """One request alone, through a fresh engine core on the loaded model `lm`."""
    core = EngineCore.for_model(
        lm, CoreLimits(max_running=1, prefill_token_budget=1 << 20, max_model_len=max_model_len)
    )
    return complete(core, [core.local_request(prompt_ids, params, **kw)])[0]
