"""The /v1/messages output: a whole message, or its event stream.

usage.input_tokens excludes the prompt tokens read from the prefix cache, which are
cache_read_input_tokens (as Anthropic defines them).  A stream sends message_start,
content_block_start / _delta (text_delta, input_json_delta, thinking_delta) / _stop,
message_delta, message_stop, and ping every PING_S of silence; an engine failure after it
began is an in-band `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from server.anthropic_errors import anthropic_sse_error
from server.chat_bridge import ChatResult, StreamFailed, chat_pieces
from server.chat_route import ChatRun
from server.errors import internal_error


def stop_reason(r: ChatResult) -> str:
    if r.finish == "tool_calls":
        return "tool_use"
    if r.finish == "length":
        return "max_tokens"
    return "stop_sequence" if r.stop_sequence is not None else "end_turn"


def usage_of(r: ChatResult) -> dict[str, Any]:
    return {
        "input_tokens": r.prompt_tokens - r.cached_tokens,
        "output_tokens": r.output_tokens,
        "cache_read_input_tokens": r.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input_of(arguments: str) -> dict[str, Any]:
    try:
        v = json.loads(arguments)
    except json.JSONDecodeError:
        return {}  # cut short by max_tokens: no arguments can be claimed
    return v if isinstance(v, dict) else {}


def whole_message(res: ChatResult, mid: str, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = (
        [{"type": "thinking", "thinking": res.reasoning, "signature": ""}] if res.reasoning else []
    )
    content += [{"type": "text", "text": res.text or ""}] if res.text or not res.calls else []
    content += [
        {
            "type": "tool_use",
            "id": tool_id(c["id"]),
            "name": c["function"]["name"],
            "input": _input_of(c["function"]["arguments"]),
        }
        for c in res.calls
    ]
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(res),
        "stop_sequence": res.stop_sequence,
        "usage": usage_of(res),
    }


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of one streamed message: which is open, at which index."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.saw_answer = False  # a text or tool_use block was opened

    def start(self, block: dict[str, Any]) -> list[str]:
        """Stop the open block (if any) and start `block`."""
        frames = [_sse("content_block_stop", {"index": self.index})] if self.kind else []
        self.index, self.kind = self.index + 1, block["type"]
        self.saw_answer = self.saw_answer or block["type"] != "thinking"
        return frames + [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> str:
        return _sse("content_block_delta", {"index": self.index, "delta": delta})


async def stream_events(run: ChatRun, mid: str, model: str) -> AsyncIterator[str]:
    def start() -> str:
        # Sent with the first piece: by then the engine has said how much of the prompt was cached.
        u = {
            "input_tokens": len(run.prompt) - run.cached,
            "output_tokens": 0,
            "cache_read_input_tokens": run.cached,
            "cache_creation_input_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
        }
        message |= {"content": [], "stop_reason": None, "stop_sequence": None, "usage": u}
        return _sse("message_start", {"message": message})

    started = False
    b = _Blocks()
    try:
        async for p in chat_pieces(run):
            if not started:
                started = True
                yield start()
            if p.kind == "wait":
                yield _sse("ping", {})
            elif p.kind == "reasoning":
                for f in (
                    b.start({"type": "thinking", "thinking": "", "signature": ""})
                    if b.kind != "thinking"
                    else []
                ):
                    yield f
                yield b.delta({"type": "thinking_delta", "thinking": p.text})
            elif p.kind == "text":
                for f in b.start({"type": "text", "text": ""}) if b.kind != "text" else []:
                    yield f
                yield b.delta({"type": "text_delta", "text": p.text})
            elif p.kind == "call":
                block = {"type": "tool_use", "id": tool_id(p.call_id), "name": p.name, "input": {}}
                for f in b.start(block):
                    yield f
                if p.text:
                    yield b.delta({"type": "input_json_delta", "partial_json": p.text})
            elif p.kind == "args" and b.kind == "tool_use":
                yield b.delta({"type": "input_json_delta", "partial_json": p.text})
            elif p.kind == "end":
                assert p.result is not None
                if not b.saw_answer:  # an empty answer is still one (empty) text block
                    for f in b.start({"type": "text", "text": ""}):
                        yield f
                yield _sse("content_block_stop", {"index": b.index})
                delta = {
                    "stop_reason": stop_reason(p.result),
                    "stop_sequence": p.result.stop_sequence,
                }
                yield _sse("message_delta", {"delta": delta, "usage": usage_of(p.result)})
                yield _sse("message_stop", {})
    except StreamFailed as e:
        if not started:
            yield start()
        yield anthropic_sse_error(e.status, e.message, e.code)
    except Exception as e:  # noqa: BLE001 - after the 200 header: an in-band error, never a cut stream
        if not started:
            yield start()
        yield anthropic_sse_error(500, internal_error(e, "a streamed message"), "internal_error")
    finally:  # a client that went away: its sequence is aborted now, not when collected
        run.choices.abort_unfinished()
