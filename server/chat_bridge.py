"""One translation layer: the Responses and Messages APIs run through the chat path.

Each API module turns its request into a `ChatCompletionRequest` and calls `start_chat`, which
does exactly what /v1/chat/completions does before its first token: the same checks, the chat
template, the sampling parameters, stop strings, grammar constraints (json_schema, forced tool
calls) and the tool mode.  So a conversation gets the same prompt tokens, and with greedy
sampling the same output, from all three APIs.  The results come back API-neutral:
`finish_chat` for a whole response, `chat_pieces` for a stream of text and tool-call pieces.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request

from server.chat_route import chat_constraint, check_messages
from server.engine_client import EngineFailure
from server.formatting import failure_of
from server.protocol import ChatCompletionRequest, new_id
from server.reasoning import ReasoningSplitter, reasoning_prompt, split_whole
from server.routes import collect
from server.state import Choices, ServerState
from server.tools import ToolMode, ToolStream, forced_body, parse_calls, tool_mode

PING_S = 10.0  # a stream that has produced nothing for this long gets a keep-alive (Anthropic ping)


@dataclass
class ChatRun:
    """One submitted chat request (always a single choice)."""

    rid: str
    choices: Choices
    prompt: list[int]
    mode: ToolMode
    tool_names: list[str]
    reasoning: bool = False  # the template has <think> sections: split them out of the output
    inside: bool = False  # the output starts inside one (the prompt opened it)
    cached: int = 0  # prompt tokens read from the prefix cache (known from the first output on)


@dataclass
class ChatResult:
    text: str | None  # content left after tool calls were taken out
    calls: list[
        dict[str, Any]
    ]  # chat-completions tool_calls entries (id, function.name, .arguments)
    finish: str  # stop | length | tool_calls
    stop_sequence: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    reasoning: str = ""  # the <think> section's text (templates with reasoning only)


@dataclass
class Piece:
    """A piece of a streamed chat output.

    reasoning: `text` continues the <think> section.  text: `text` continues the visible content.  call: a new tool call (`call_id`, `name`,
    first `text` of its arguments).  args: more argument text for call `index`.  wait: nothing
    new for PING_S seconds.  end: the output is complete (`result` holds the totals).
    """

    kind: Literal["reasoning", "text", "call", "args", "wait", "end"]
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""
    result: ChatResult | None = None


@dataclass
class StreamFailed(Exception):
    """The engine failed after the stream began: the API sends its in-band error event."""

    status: int
    message: str
    code: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


async def start_chat(
    st: ServerState, body: ChatCompletionRequest, id_prefix: str, thinking: bool | None = None
) -> ChatRun:
    """Validate, template and submit `body` exactly as /v1/chat/completions does (n must be 1)."""
    assert body.n == 1
    st.check_model(body.model)
    check_messages(st, body)
    st.check_accepting(1)
    mode = tool_mode(body)
    # The prompt shows the tools as sent; a forced call only changes what the output may be.
    if (forced := forced_body(body, st.settings.forced_tools)) is not None:
        mode = tool_mode(forced)
    constraint = await chat_constraint(st, forced or body, mode)
    prompt, reasoning, inside = await reasoning_prompt(st, body, thinking)
    rid = new_id(id_prefix)
    choices = st.submit(
        st.make_requests(rid, [prompt], body, body.token_limit(), None, None, constraint)
    )
    return ChatRun(
        rid,
        choices,
        prompt,
        mode,
        [t.function.name for t in body.tools or []],
        reasoning and constraint is None,
        inside,
    )


async def finish_chat(run: ChatRun, raw: Request) -> ChatResult | None:
    """The whole output; None if the client went away (the sequence is aborted)."""
    accs = await collect(run.choices, raw)
    if accs is None:
        return None
    a = accs[0]
    finish = a.finish_reason or "stop"
    reasoning, text = split_whole(a.text, run.inside) if run.reasoning else ("", a.text)
    content: str | None = text
    calls: list[dict[str, Any]] = []
    if run.mode.kind != "none":
        content, calls = parse_calls(text, run.mode, run.tool_names)
        if calls and finish == "stop":
            finish = "tool_calls"
    return ChatResult(
        content,
        calls,
        finish,
        a.stop_sequence,
        len(run.prompt),
        a.num_output_tokens,
        a.num_cached_tokens,
        reasoning,
    )


async def chat_pieces(run: ChatRun) -> AsyncIterator[Piece]:
    """Stream pieces in order; raises StreamFailed if the engine fails.  Closing the generator
    (client gone) aborts the sequence."""
    stream = ToolStream(run.mode, run.tool_names) if run.mode.kind != "none" else None
    think = ReasoningSplitter(run.inside) if run.reasoning else None
    n_calls = 0
    try:
        while not run.choices.done:
            try:
                got = await run.choices.next(timeout=PING_S)
            except EngineFailure as e:
                raise StreamFailed(503, f"The engine failed: {e}", e.code) from None
            if got is None:
                yield Piece("wait")
                continue
            o = got[1]
            run.cached = o.num_cached_tokens
            if (f := failure_of(o.finish_reason, o.error)) is not None:
                raise StreamFailed(*f)
            text = o.text
            if think is not None:
                r, text = think.feed(o.text)
                if o.finish_reason is not None:
                    r2, c2 = think.finish()
                    r, text = r + r2, text + c2
                if r:
                    yield Piece("reasoning", r)
            deltas: list[dict[str, Any]] = (
                [stream.feed(text)] if stream is not None else [{"content": text}]
            )
            has_calls = False
            if stream is not None and o.finish_reason is not None:
                last, has_calls = stream.finish()
                deltas.append(last)
            for d in deltas:
                if d.get("content"):
                    yield Piece("text", d["content"])
                for c in d.get("tool_calls", []):
                    if "id" in c:
                        n_calls += 1
                        yield Piece(
                            "call",
                            c["function"].get("arguments", ""),
                            n_calls - 1,
                            c["id"],
                            c["function"]["name"],
                        )
                    elif c["function"].get("arguments"):
                        yield Piece("args", c["function"]["arguments"], c["index"])
            if o.finish_reason is not None:
                finish = (
                    "tool_calls" if has_calls and o.finish_reason == "stop" else o.finish_reason
                )
                yield Piece(
                    "end",
                    result=ChatResult(
                        None,
                        [],
                        finish,
                        o.stop_sequence,
                        len(run.prompt),
                        o.num_output_tokens,
                        o.num_cached_tokens,
                    ),
                )
    finally:
        run.choices.abort_unfinished()
