"""OpenAI wire objects built from engine outputs: logprobs, SSE framing, accumulated choices."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import RequestOutput, TokenLogprob, fault_class
from server.errors import error_body


def sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(status: int, message: str, code: str | None) -> str:
    """In-band failure after the 200 header went out; the stream still ends with [DONE]."""
    return sse(error_body(status, message, None, code))


def chat_logprobs(entries: list[TokenLogprob], text_of: Callable[[int], str]) -> dict[str, Any]:
    def one(tid: int, lp: float) -> dict[str, Any]:
        s = text_of(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    ids: list[int],
    entries: list[TokenLogprob | None],
    text_of: Callable[[int], str],
    offset: int,
    eos: TokenLogprob | None = None,
) -> dict[str, Any]:
    """Legacy format; `offset` is the character position of the first token in the choice text.

    As vLLM and OpenAI do (and lm_eval relies on): each top_logprobs dict also holds the chosen
    token when it is not among the top k (up to k+1 entries), and a terminating EOS token is
    listed last (`eos`) although its text is not part of the choice's text.
    """
    tokens, offsets = [], []
    for t in ids:
        offsets.append(offset)
        s = text_of(t)
        tokens.append(s)
        offset += len(s)
    if eos is not None:
        ids, entries = [*ids, eos.token_id], [*entries, eos]
        offsets.append(offset)
        tokens.append(text_of(eos.token_id))
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else _top_with_chosen(e, text_of) for e in entries],
        "text_offset": offsets,
    }


def _top_with_chosen(e: TokenLogprob, text_of: Callable[[int], str]) -> dict[str, float]:
    top = {text_of(t): lp for t, lp in e.top}
    if e.top and all(t != e.token_id for t, _ in e.top):
        top[text_of(e.token_id)] = e.logprob
    return top


@dataclass
class Accumulated:
    """One choice's full result, for non-streamed responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_output_tokens: int = 0
    eos_logprob: TokenLogprob | None = None
    stop_sequence: str | None = None
    num_cached_tokens: int = 0

    def add(self, o: RequestOutput) -> None:
        self.text += o.text
        self.token_ids += o.token_ids
        self.logprobs += o.logprobs or []
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        self.num_output_tokens = o.num_output_tokens
        self.num_cached_tokens = o.num_cached_tokens
        self.eos_logprob = o.eos_logprob or self.eos_logprob
        if o.finish_reason is not None:
            self.finish_reason, self.error, self.stop_sequence = (
                o.finish_reason,
                o.error,
                o.stop_sequence,
            )


def failure_of(reason: str | None, error: str | None) -> tuple[int, str, str] | None:
    """(status, message, code) when a choice ended without a result, else None."""
    if reason == "abort":
        return 503, "The request was aborted (server shutting down).", "aborted"
    if reason == "error":  # `code` names the fault class: expert_read_failed, sampling_failed, ...
        return 500, f"The engine failed on this request: {error}", fault_class(error)
    return None
