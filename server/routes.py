"""POST /v1/chat/completions and /v1/completions: validate, submit, stream or collect."""
from __future__ import annotations

import time

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.engine_client import EngineFailure
from server.errors import ApiError
from server.formatting import Accumulated, chat_logprobs, completion_logprobs, failure_of, sse, sse_error
from server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now, usage
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
        raise ApiError(503, f"The engine failed: {e}", code="engine_dead") from None
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
        yield sse_error(503, f"The engine failed: {e}", "engine_dead")
    finally:
        choices.abort_unfinished()
    yield sse("[DONE]")


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def chat_completions(st: ServerState, body: ChatCompletionRequest, raw: Request) -> Any:
    st.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    prompt = st.chat_prompt(body.messages)
    lp = (body.top_logprobs or 0) if body.logprobs else None
    rid, created, model = new_id("chatcmpl"), now(), st.settings.served_model_name
    choices = st.submit(st.make_requests(rid, [prompt], body, body.token_limit(), lp, None))
    n_out = [0] * len(choices.rids)

    if not body.stream:
        accs = await collect(choices, raw)
        if accs is None:
            return JSONResponse({}, status_code=499)
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{
                "index": i, "message": {"role": "assistant", "content": a.text},
                "logprobs": chat_logprobs(a.logprobs, st.token_text) if lp is not None else None,
                "finish_reason": a.finish_reason,
            } for i, a in enumerate(accs)],
            "usage": usage(len(prompt), sum(a.num_output_tokens for a in accs)),
        }

    extra = {"usage": None} if body.include_usage() else {}

    def chunk(i: int, o: Any) -> dict[str, Any] | None:
        if o is None:  # opening chunk: the role, once per choice
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
            lps = None
        else:
            n_out[i] = o.num_output_tokens
            if not o.text and not o.finish_reason and not (lp is not None and o.token_ids):
                return None
            delta = {"content": o.text} if o.text else {}
            lps = chat_logprobs(o.logprobs or [], st.token_text) if lp is not None else None
        c = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": None if o is None else o.finish_reason}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [c], **extra}

    def final() -> dict[str, Any] | None:
        if not body.include_usage():
            return None
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage(len(prompt), sum(n_out))}

    return _sse_response(stream_events(choices, chunk, final))


async def completions(st: ServerState, body: CompletionRequest, raw: Request) -> Any:
    st.check_model(body.model)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    prompts = st.text_prompts(body.prompt)
    lp = body.logprobs
    plp = lp if (body.echo and lp is not None) else None
    rid, created, model = new_id("cmpl"), now(), st.settings.served_model_name
    choices = st.submit(st.make_requests(rid, prompts, body, body.token_limit(), lp, plp))
    prompt_of = [prompts[i // body.n] for i in range(len(choices.rids))]
    prompt_text = [st.tokenizer.decode(p) if body.echo else "" for p in prompt_of]
    n_prompt = sum(len(p) for p in prompts)
    n_out = [0] * len(choices.rids)
    offsets = [0] * len(choices.rids)  # characters of each choice's text already sent

    def logprobs_of(i: int, ids: list[int], entries: list[Any], plps: list[Any] | None) -> dict[str, Any] | None:
        if lp is None:
            return None
        if plps is not None:  # echo: the prompt's tokens come first
            ids, entries = prompt_of[i] + ids, plps + entries
        return completion_logprobs(ids, entries, st.token_text, offsets[i])

    if not body.stream:
        accs = await collect(choices, raw)
        if accs is None:
            return JSONResponse({}, status_code=499)
        return {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{
                "index": i, "text": prompt_text[i] + a.text,
                "logprobs": logprobs_of(i, a.token_ids, list(a.logprobs), a.prompt_logprobs),
                "finish_reason": a.finish_reason,
            } for i, a in enumerate(accs)],
            "usage": usage(n_prompt, sum(a.num_output_tokens for a in accs)),
        }

    extra = {"usage": None} if body.include_usage() else {}
    started = [False] * len(choices.rids)

    def chunk(i: int, o: Any) -> dict[str, Any] | None:
        if o is None:
            return None
        n_out[i] = o.num_output_tokens
        text = o.text if started[i] else prompt_text[i] + o.text
        started[i] = True
        if not text and not o.finish_reason and not (lp is not None and o.token_ids):
            return None
        c = {"index": i, "text": text, "logprobs": logprobs_of(i, o.token_ids, list(o.logprobs or []), o.prompt_logprobs), "finish_reason": o.finish_reason}
        offsets[i] += len(text)
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [c], **extra}

    def final() -> dict[str, Any] | None:
        if not body.include_usage():
            return None
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": usage(n_prompt, sum(n_out))}

    return _sse_response(stream_events(choices, chunk, final))
