"""The /v1/responses output: the response object, its output items, and its typed event stream.

Output: a `reasoning` item (templates with <think>), a `message` item with one `output_text`
part when there is text, then one `function_call` item per call (a namespaced function's
call names its `namespace`).  status is "incomplete" (incomplete_details.reason
"max_output_tokens") when the token limit cut the output.

A stream sends the typed events the openai SDK's `responses.stream()` assembles, each with a
`sequence_number`, and always ends with `response.completed`, its `response.status` saying
completed or incomplete: that is the event the SDK's `get_final_response()` waits for (and
what vLLM and llama.cpp send).  An engine failure after the stream began is an `error` event
(carrying an `error` object too, so the SDK raises openai.APIError with its message) and then
`response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.chat_bridge import ChatResult, StreamFailed, chat_pieces
from server.chat_route import ChatRun
from server.errors import internal_error
from server.responses_request import NamedFunction, ResponsesRequest

# (status, output items, result, the turn's text, its calls) -> the final response (stored if asked)
Finisher = Callable[
    [str, list[dict[str, Any]], ChatResult, str, list[dict[str, Any]]], dict[str, Any]
]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


def rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def call_item(
    call_id: str, flat: str, arguments: str, status: str, spaced: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    """A function_call item; a namespaced function is named as the client defined it."""
    item: dict[str, Any] = {"type": "function_call", "id": rid("fc"), "call_id": call_id}
    if flat in spaced:
        item["namespace"], item["name"] = spaced[flat]
    else:
        item["name"] = flat
    return {**item, "arguments": arguments, "status": status}


def status_of(result: ChatResult) -> Literal["completed", "incomplete"]:
    return "incomplete" if result.finish == "length" else "completed"


def whole_output(result: ChatResult, spaced: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """The output items of a finished (not streamed) response."""
    status, text = status_of(result), result.text or ""
    output: list[dict[str, Any]] = []
    if result.reasoning:
        output.append(
            ReasoningItem(
                id=rid("rs"), status=status, content=[ReasoningText(text=result.reasoning)]
            ).model_dump()
        )
    if text or not result.calls:
        output.append(
            MessageItem(id=rid("msg"), status=status, content=[OutputText(text=text)]).model_dump()
        )
    output += [
        call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed", spaced)
        for c in result.calls
    ]
    return output


class ResponseObject:
    """The response object, before and after its output (shared by streamed and whole responses)."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id = rid("resp")
        self.created = int(time.time())

    def obj(
        self, status: str, output: list[dict[str, Any]], result: ChatResult | None, store: bool
    ) -> dict[str, Any]:
        b = self.body
        usage = None
        if result is not None:
            usage = {
                "input_tokens": result.prompt_tokens,
                "input_tokens_details": {"cached_tokens": result.cached_tokens},
                "output_tokens": result.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": result.prompt_tokens + result.output_tokens,
            }
        fmt = (
            b.text.format.model_dump(by_alias=True, exclude_none=True)
            if b.text
            else {"type": "text"}
        )
        choice = (
            b.tool_choice.model_dump(exclude_none=True)
            if isinstance(b.tool_choice, NamedFunction)
            else (b.tool_choice or "auto")
        )
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": store,
            "temperature": b.temperature,
            "text": {"format": fmt},
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": b.user,
            "metadata": b.metadata or {},
        }


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class EventWriter:
    """The typed events of one streamed response, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed

    def ev(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return _sse({"type": kind, "sequence_number": self.seq - 1, **fields})

    def close(self) -> list[str]:
        """Finish the open item (if any): its .done events."""
        if self.open is None:
            return []
        item, idx, self.open = self.open, len(self.output), None
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": idx}
        out: list[str] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = "output_text" if item["type"] == "message" else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            out += [
                self.ev(f"response.{done}.done", **at, content_index=0, text=part["text"], **extra),
                self.ev("response.content_part.done", **at, content_index=0, part=part),
            ]
        else:
            out.append(
                self.ev(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        self.output.append(item)
        out.append(self.ev("response.output_item.done", output_index=idx, item=item))
        return out

    def open_part(self, reasoning: bool = False) -> list[str]:
        """Close the open item, then open a message (or reasoning) item with one empty part."""
        frames = self.close()
        if reasoning:
            item = ReasoningItem(id=rid("rs"), status="in_progress", content=[]).model_dump()
            part = ReasoningText(text="").model_dump()
        else:
            item = MessageItem(id=rid("msg"), status="in_progress", content=[]).model_dump()
            part = OutputText(text="").model_dump()
        idx = len(self.output)
        frames.append(self.ev("response.output_item.added", output_index=idx, item=dict(item)))
        item["content"] = [part]
        self.open = item
        return frames + [
            self.ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                part=dict(part),
            )
        ]

    def delta(self, kind: str, text: str) -> str:
        """More text for the open item: reasoning_text, output_text or function_call_arguments."""
        assert self.open is not None
        at = {"item_id": self.open["id"], "output_index": len(self.output)}
        if kind == "function_call_arguments":
            self.open["arguments"] += text
            return self.ev("response.function_call_arguments.delta", **at, delta=text)
        self.open["content"][0]["text"] += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
        return self.ev(f"response.{kind}.delta", **at, content_index=0, delta=text, **extra)


def _failed(resp: ResponseObject, w: EventWriter, code: str | None, message: str) -> list[str]:
    """The end of a stream that failed after its 200 header: `error`, then `response.failed`;
    both name the fault class (`engine_restarted`, `expert_read_failed`, `internal_error`, ...)."""
    failed = resp.obj("failed", w.output, None, False)
    failed["error"] = {"code": code or "server_error", "message": message}
    err = {"code": code, "message": message, "param": None}
    return [
        w.ev("error", **err, error={"type": "server_error", **err}),
        w.ev("response.failed", response=failed),
    ]


async def stream_events(
    resp: ResponseObject, run: ChatRun, spaced: dict[str, tuple[str, str]], finish: Finisher
) -> AsyncIterator[str]:
    """The SSE frames of a streamed response; `finish` builds (and stores) the final object."""
    w = EventWriter()
    text = ""  # the assistant turn, for the store
    calls: list[dict[str, Any]] = []
    store = resp.body.store
    yield w.ev("response.created", response=resp.obj("in_progress", [], None, store))
    yield w.ev("response.in_progress", response=resp.obj("in_progress", [], None, store))
    try:
        async for p in chat_pieces(run):
            kind = w.open["type"] if w.open is not None else None
            if p.kind == "reasoning":
                for f in w.open_part(reasoning=True) if kind != "reasoning" else []:
                    yield f
                yield w.delta("reasoning_text", p.text)
            elif p.kind == "text":
                for f in w.open_part() if kind != "message" else []:
                    yield f
                text += p.text
                yield w.delta("output_text", p.text)
            elif p.kind == "call":
                for f in w.close():
                    yield f
                w.open = call_item(p.call_id, p.name, "", "in_progress", spaced)
                calls.append(
                    {
                        "id": p.call_id,
                        "type": "function",
                        "function": {"name": p.name, "arguments": ""},
                    }
                )
                yield w.ev(
                    "response.output_item.added", output_index=len(w.output), item=dict(w.open)
                )
                if p.text:
                    calls[-1]["function"]["arguments"] += p.text
                    yield w.delta("function_call_arguments", p.text)
            elif p.kind == "args" and kind == "function_call":
                calls[-1]["function"]["arguments"] += p.text
                yield w.delta("function_call_arguments", p.text)
            elif p.kind == "end":
                assert p.result is not None
                items = w.output + ([w.open] if w.open else [])
                if not any(i["type"] != "reasoning" for i in items):
                    for f in w.open_part():  # no message or call: still one (empty) message
                        yield f
                for f in w.close():
                    yield f
                status = status_of(p.result)
                if status == "incomplete":
                    for item in w.output:
                        item["status"] = "incomplete"
                final = finish(status, w.output, p.result, text, calls)
                yield w.ev("response.completed", response=final)
    except StreamFailed as e:
        for f in _failed(resp, w, e.code, e.message):
            yield f
    except Exception as e:  # noqa: BLE001 - after the 200 header: an in-band error, never a cut stream
        for f in _failed(resp, w, "internal_error", internal_error(e, "a streamed response")):
            yield f
    finally:  # a client that went away: its sequence is aborted now, not when collected
        run.choices.abort_unfinished()
