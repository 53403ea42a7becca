"""POST /v1/completions, and what every generation route shares: collect the whole answer, or
stream its chunks as server-sent events (the chat route: server/chat_route.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.engine_client import EngineFailure
from server.errors import ApiError, internal_error
from server.formatting import (
    Accumulated,
    completion_logprobs,
    failure_of,
    sse,
    sse_error,
)
from server.protocol import CompletionRequest, new_id, now, usage
from server.state import Choices, ServerState

DISCONNECT_POLL_S = 0.5


async def collect(choices: Choices, raw: Request) -> list[Accumulated] | None:
    """Wait for every choice; None if the client went away (its sequences are aborted)."""
    accs = [Accumulated() for _ in choices.rids]
    last_check = time.monotonic()
    try:
        while not choices.done:
            got = await choices.next(timeout=DISCONNECT_POLL_S)
            if got is not None:
                accs[got[0]].add(got[1])
            # Check on a clock, not only when the engine is quiet: while tokens keep coming,
            # a client that left would otherwise be served to the end.
            if got is None or time.monotonic() - last_check >= DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await raw.is_disconnected():
                    return None
    except EngineFailure as e:
        raise ApiError(503, f"The engine failed: {e}", code=e.code) from None
    finally:
        choices.abort_unfinished()
    for a in accs:
        if (f := failure_of(a.finish_reason, a.error)) is not None:
            raise ApiError(f[0], f[1], code=f[2])
    return accs


async def stream_events(choices: Choices, make_chunk: Any, final_usage: Any) -> AsyncIterator[str]:
    """SSE frames: per-output chunks from `make_chunk(index, output)`, then usage and [DONE].

    Cancellation (client disconnect) lands in an await here; `finally` aborts the sequences.
    """
    try:
        for i in range(len(choices.rids)):
            if (first := make_chunk(i, None)) is not None:
                yield sse(first)
        while not choices.done:
            got = await choices.next()
            assert got is not None
            i, o = got
            if (f := failure_of(o.finish_reason, o.error)) is not None:
                yield sse_error(*f)
                break
            if (chunk := make_chunk(i, o)) is not None:
                yield sse(chunk)
        else:
            if (u := final_usage()) is not None:
                yield sse(u)
    except EngineFailure as e:
        yield sse_error(503, f"The engine failed: {e}", e.code)
    except Exception as e:  # noqa: BLE001 - after the 200 header: an in-band error, never a cut stream
        yield sse_error(500, internal_error(e, "a streamed response"), "internal_error")
    finally:
        choices.abort_unfinished()
    yield sse("[DONE]")


def _cached(per_choice: list[int], n: int) -> int:
    """Prompt tokens read from the prefix cache: once per prompt (its n choices share it)."""
    return sum(max(per_choice[k : k + n]) for k in range(0, len(per_choice), n))


def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def completions(st: ServerState, body: CompletionRequest, raw: Request) -> Any:
    st.check_model(body.model)
    _check_completion(body)
    batch = (
        body.prompt
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
        else [body.prompt]
    )
    st.check_accepting(body.n * len(batch))  # refuse early (draining, queue full), untokenized
    prompts = await st.off_loop(st.text_prompts, body.prompt)
    lp = body.logprobs
    plp = lp if (body.echo and lp is not None) else None
    rid = new_id("cmpl")
    choices = st.submit(st.make_requests(rid, prompts, body, body.token_limit(), lp, plp))
    prompt_of = [prompts[i // body.n] for i in range(len(choices.rids))]
    prompt_text = await st.off_loop(
        lambda: [st.tokenizer.decode(p) if body.echo else "" for p in prompt_of]
    )
    out = _Completion(st, body, rid, prompt_of, prompt_text)
    if body.stream:
        return sse_response(stream_events(choices, out.chunk, out.final))
    accs = await collect(choices, raw)
    if accs is None:
        return JSONResponse({}, status_code=499)
    return out.whole(accs)


def _check_completion(body: CompletionRequest) -> None:
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            400,
            "max_tokens 0 is only allowed with echo=true (prompt logprobs only)",
            param="max_tokens",
        )


class _Completion:
    """A submitted text completion's answer: whole, or a text_completion chunk per engine output
    (with echo the prompt's text and logprobs first; max_tokens 0 sends the prompt's only)."""

    def __init__(
        self,
        st: ServerState,
        body: CompletionRequest,
        rid: str,
        prompt_of: list[list[int]],
        prompt_text: list[str],
    ) -> None:
        self.st, self.body, self.prompt_of, self.prompt_text = st, body, prompt_of, prompt_text
        self.head = {"id": rid, "object": "text_completion", "created": now()}
        self.head["model"] = st.settings.served_model_name
        self.prompt_only = body.max_tokens == 0  # the engine samples one token; dropped here
        # Distinct prompts' tokens: each prompt is n choices' prompt.
        self.n_prompt = sum(len(p) for p in prompt_of[:: body.n])
        k = len(prompt_of)
        self.n_out, self.n_cached = [0] * k, [0] * k
        self.offsets = [0] * k  # characters of each choice's text already sent
        self.started = [False] * k
        self.extra = {"usage": None} if body.include_usage() else {}

    def logprobs_of(
        self, i: int, ids: list[int], entries: list[Any], plps: list[Any] | None, eos: Any
    ) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        if self.prompt_only:
            ids, entries, eos = [], [], None
        if plps is not None:  # echo: the prompt's tokens come first
            ids, entries = self.prompt_of[i] + ids, plps + entries
        return completion_logprobs(ids, entries, self.st.token_text, self.offsets[i], eos)

    def whole(self, accs: list[Accumulated]) -> dict[str, Any]:
        only = self.prompt_only
        return {
            **self.head,
            "choices": [
                {
                    "index": i,
                    "text": self.prompt_text[i] + ("" if only else a.text),
                    "logprobs": self.logprobs_of(
                        i, a.token_ids, list(a.logprobs), a.prompt_logprobs, a.eos_logprob
                    ),
                    "finish_reason": "length" if only else a.finish_reason,
                }
                for i, a in enumerate(accs)
            ],
            "usage": usage(
                self.n_prompt,
                0 if only else sum(a.num_output_tokens for a in accs),
                _cached([a.num_cached_tokens for a in accs], self.body.n),
            ),
        }

    def chunk(self, i: int, o: Any) -> dict[str, Any] | None:
        if o is None:
            return None
        only = self.prompt_only
        self.n_out[i] = 0 if only else o.num_output_tokens
        self.n_cached[i] = o.num_cached_tokens
        new = "" if only else o.text
        text = new if self.started[i] else self.prompt_text[i] + new
        self.started[i] = True
        finish = ("length" if o.finish_reason else None) if only else o.finish_reason
        wants_lp = self.body.logprobs is not None and o.token_ids and not only
        if not text and not finish and not wants_lp:
            return None
        c = {
            "index": i,
            "text": text,
            "logprobs": self.logprobs_of(
                i, o.token_ids, list(o.logprobs or []), o.prompt_logprobs, o.eos_logprob
            ),
            "finish_reason": finish,
        }
        self.offsets[i] += len(text)
        return {**self.head, "choices": [c], **self.extra}

    def final(self) -> dict[str, Any] | None:
        if not self.body.include_usage():
            return None
        return {
            **self.head,
            "choices": [],
            "usage": usage(self.n_prompt, sum(self.n_out), _cached(self.n_cached, self.body.n)),
        }
