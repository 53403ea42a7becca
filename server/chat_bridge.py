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

from server.chat_route import ChatRun, OutputSplit, submit_chat, whole_output
from server.engine_client import EngineFailure
from server.formatting import failure_of
from server.protocol import ChatCompletionRequest
from server.routes import collect
from server.state import ServerState

PING_S = 10.0  # a stream that has produced nothing for this long gets a keep-alive (Anthropic ping)


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
    return await submit_chat(st, body, id_prefix, thinking, forced_tools=True)


async def finish_chat(run: ChatRun, raw: Request) -> ChatResult | None:
    """The whole output; None if the client went away (the sequence is aborted)."""
    accs = await collect(run.choices, raw)
    if accs is None:
        return None
    a = accs[0]
    finish = a.finish_reason or "stop"
    reasoning, content, calls = whole_output(run, a.text)
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
    split = OutputSplit(run)
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
            r, deltas, has_calls = split.feed(o.text, o.finish_reason is not None)
            if r:
                yield Piece("reasoning", r)
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
