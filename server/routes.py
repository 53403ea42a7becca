"""POST /v1/chat/completions and /v1/completions: validate, submit, stream or collect."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.structured.constraint import check_spec
from engine.structured.spec import ConstraintSpec
from server.engine_client import EngineFailure
from server.errors import ApiError, internal_error
from server.formatting import (
    Accumulated,
    chat_logprobs,
    completion_logprobs,
    failure_of,
    sse,
    sse_error,
)
from server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now, usage
from server.reasoning import ReasoningSplitter, reasoning_prompt, split_whole, thinking_of_effort
from server.state import Choices, ServerState
from server.tools import ToolMode, ToolStream, parse_calls, tool_constraint, tool_mode

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


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _chat_constraint(
    st: ServerState, body: ChatCompletionRequest, mode: ToolMode
) -> ConstraintSpec | None:
    """The grammar a chat request's output must follow, checked here so a bad schema is a 400."""
    fmt = body.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if mode.constrained and wants_json:
        raise ApiError(
            400,
            "response_format cannot be combined with a tool_choice that forces a call",
            param="response_format",
        )
    if mode.constrained:
        spec, param = tool_constraint(body, mode), "tools"
    elif fmt is not None and fmt.type == "json_object":
        spec, param = ConstraintSpec("json_object"), "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        spec, param = (
            ConstraintSpec.json_schema(fmt.json_schema.schema_),
            "response_format.json_schema.schema",
        )
    else:
        return None
    assert spec is not None
    if body.ignore_eos:
        raise ApiError(
            400,
            "ignore_eos cannot be combined with structured output (the grammar ends the output)",
            param="ignore_eos",
        )
    if (err := await st.off_loop(check_spec, spec)) is not None:
        raise ApiError(400, f"invalid schema: {err}", param=param)
    return spec


def _check_messages(st: ServerState, body: ChatCompletionRequest) -> None:
    if len(body.messages) > st.settings.server.max_messages:
        raise ApiError(
            400, f"at most {st.settings.server.max_messages} messages per request", param="messages"
        )
    for i, m in enumerate(body.messages):
        if (bad := m.unsupported_part()) is not None:
            raise ApiError(
                400,
                f"content parts of type `{bad[1]}` are not supported: this server reads text only",
                param=f"messages[{i}].content[{bad[0]}].type",
                code="unsupported_content",
            )
    st.check_text_length(sum(len(m.text()) for m in body.messages), "messages")


async def chat_completions(st: ServerState, body: ChatCompletionRequest, raw: Request) -> Any:
    st.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    _check_messages(st, body)
    st.check_accepting(body.n)  # refuse early (draining, queue full) before any tokenizing
    mode = tool_mode(body)
    constraint = await _chat_constraint(st, body, mode)
    prompt, reasoning, inside = await reasoning_prompt(
        st, body, thinking_of_effort(body.reasoning_effort)
    )
    reasoning = (
        reasoning and constraint is None
    )  # a grammar-constrained output has no <think> section
    lp = (body.top_logprobs or 0) if body.logprobs else None
    rid, created, model = new_id("chatcmpl"), now(), st.settings.served_model_name
    choices = st.submit(
        st.make_requests(rid, [prompt], body, body.token_limit(), lp, None, constraint)
    )
    n_out = [0] * len(choices.rids)
    n_cached = [0] * len(choices.rids)
    names = [t.function.name for t in body.tools or []]
    parse_tools = mode.kind != "none"

    if not body.stream:
        accs = await collect(choices, raw)
        if accs is None:
            return JSONResponse({}, status_code=499)
        out = []
        for i, a in enumerate(accs):
            thought, text = split_whole(a.text, inside) if reasoning else ("", a.text)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = a.finish_reason
            if parse_tools:
                content, calls = parse_calls(text, mode, names)
                message = {
                    "role": "assistant",
                    "content": content,
                    **({"tool_calls": calls} if calls else {}),
                }
                if calls and finish == "stop":
                    finish = "tool_calls"
            if reasoning:
                message["reasoning_content"] = thought or None
            out.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(a.logprobs, st.token_text)
                    if lp is not None
                    else None,
                    "finish_reason": finish,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": out,
            "usage": usage(
                len(prompt),
                sum(a.num_output_tokens for a in accs),
                max(a.num_cached_tokens for a in accs),
            ),
        }

    extra = {"usage": None} if body.include_usage() else {}
    streams = [ToolStream(mode, names) for _ in choices.rids] if parse_tools else None
    thinks = [ReasoningSplitter(inside) for _ in choices.rids] if reasoning else None

    def chunk(i: int, o: Any) -> dict[str, Any] | None:
        if o is None:  # opening chunk: the role, once per choice
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
            lps = None
            finish = None
        else:
            n_out[i], n_cached[i] = o.num_output_tokens, o.num_cached_tokens
            finish = o.finish_reason
            text, thought = o.text, ""
            if thinks is not None:  # the <think> section's text goes to delta.reasoning_content
                thought, text = thinks[i].feed(o.text)
                if finish is not None:
                    r2, c2 = thinks[i].finish()
                    thought, text = thought + r2, text + c2
            if streams is not None:
                delta = streams[i].feed(text)
                if finish is not None:
                    last, has_calls = streams[i].finish()
                    for k, v in last.items():  # content and tool_calls of the final piece
                        delta[k] = (
                            delta.get(k, []) + v if k == "tool_calls" else delta.get(k, "") + v
                        )
                    if has_calls and finish == "stop":
                        finish = "tool_calls"
            else:
                delta = {"content": text} if text else {}
            if thought:
                delta = {"reasoning_content": thought, **delta}
            if not delta and not finish and not (lp is not None and o.token_ids):
                return None
            lps = chat_logprobs(o.logprobs or [], st.token_text) if lp is not None else None
        c = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [c],
            **extra,
        }

    def final() -> dict[str, Any] | None:
        if not body.include_usage():
            return None
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(len(prompt), sum(n_out), max(n_cached)),
        }

    return _sse_response(stream_events(choices, chunk, final))


async def completions(st: ServerState, body: CompletionRequest, raw: Request) -> Any:
    st.check_model(body.model)
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            400,
            "max_tokens 0 is only allowed with echo=true (prompt logprobs only)",
            param="max_tokens",
        )
    batch = (
        body.prompt
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
        else [body.prompt]
    )
    st.check_accepting(
        body.n * len(batch)
    )  # refuse early (draining, queue full) before any tokenizing
    prompts = await st.off_loop(st.text_prompts, body.prompt)
    lp = body.logprobs
    plp = lp if (body.echo and lp is not None) else None
    prompt_only = body.max_tokens == 0  # the engine still samples one token; it is dropped here
    rid, created, model = new_id("cmpl"), now(), st.settings.served_model_name
    choices = st.submit(st.make_requests(rid, prompts, body, body.token_limit(), lp, plp))
    prompt_of = [prompts[i // body.n] for i in range(len(choices.rids))]
    prompt_text = await st.off_loop(
        lambda: [st.tokenizer.decode(p) if body.echo else "" for p in prompt_of]
    )
    n_prompt = sum(len(p) for p in prompts)
    n_out = [0] * len(choices.rids)
    offsets = [0] * len(choices.rids)  # characters of each choice's text already sent

    def logprobs_of(
        i: int, ids: list[int], entries: list[Any], plps: list[Any] | None, eos: Any
    ) -> dict[str, Any] | None:
        if lp is None:
            return None
        if prompt_only:
            ids, entries, eos = [], [], None
        if plps is not None:  # echo: the prompt's tokens come first
            ids, entries = prompt_of[i] + ids, plps + entries
        return completion_logprobs(ids, entries, st.token_text, offsets[i], eos)

    if not body.stream:
        accs = await collect(choices, raw)
        if accs is None:
            return JSONResponse({}, status_code=499)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "text": prompt_text[i] + ("" if prompt_only else a.text),
                    "logprobs": logprobs_of(
                        i, a.token_ids, list(a.logprobs), a.prompt_logprobs, a.eos_logprob
                    ),
                    "finish_reason": "length" if prompt_only else a.finish_reason,
                }
                for i, a in enumerate(accs)
            ],
            "usage": usage(
                n_prompt,
                0 if prompt_only else sum(a.num_output_tokens for a in accs),
                _cached([a.num_cached_tokens for a in accs], body.n),
            ),
        }

    extra = {"usage": None} if body.include_usage() else {}
    started = [False] * len(choices.rids)
    n_cached = [0] * len(choices.rids)

    def chunk(i: int, o: Any) -> dict[str, Any] | None:
        if o is None:
            return None
        n_out[i] = 0 if prompt_only else o.num_output_tokens
        n_cached[i] = o.num_cached_tokens
        new = "" if prompt_only else o.text
        text = new if started[i] else prompt_text[i] + new
        started[i] = True
        finish = ("length" if o.finish_reason else None) if prompt_only else o.finish_reason
        if not text and not finish and not (lp is not None and o.token_ids and not prompt_only):
            return None
        c = {
            "index": i,
            "text": text,
            "logprobs": logprobs_of(
                i, o.token_ids, list(o.logprobs or []), o.prompt_logprobs, o.eos_logprob
            ),
            "finish_reason": finish,
        }
        offsets[i] += len(text)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [c],
            **extra,
        }

    def final() -> dict[str, Any] | None:
        if not body.include_usage():
            return None
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage(n_prompt, sum(n_out), _cached(n_cached, body.n)),
        }

    return _sse_response(stream_events(choices, chunk, final))
