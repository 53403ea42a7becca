"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API.

A request becomes a chat request (server/chat_bridge.py): `instructions` is a system message,
`input` items become messages (function_call items an assistant's tool_calls,
function_call_output items tool messages), `text.format` becomes response_format, and flat
function tools become chat tools.  With `previous_response_id`, the stored conversation of
that response comes first (its instructions are not carried over, as OpenAI specifies).

Output: a `message` item with one `output_text` part when there is text, then one
`function_call` item per call.  status is "incomplete" (incomplete_details.reason
"max_output_tokens") when the token limit cut the output.  Streaming sends the typed events
that the openai SDK's `responses.stream()` assembles, each with a `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.chat_bridge import (
    ChatResult,
    StreamFailed,
    chat_pieces,
    finish_chat,
    start_chat,
)
from server.errors import ApiError
from server.openapi import error_responses, json_or_stream
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    ToolCall,
    ToolCallFunction,
)
from server.reasoning import thinking_of_effort
from server.response_store import ResponseStore
from server.state import ServerState

SUPPORTED_PARTS = ("input_text", "output_text", "text")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputPart(_Lenient):
    type: str
    text: str = ""


class InputItem(_Lenient):
    """A message (role + content), a function_call, or a function_call_output."""

    type: str | None = None  # absent with a role: a message
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(_Lenient):
    type: str  # only "function" is served; checked in `to_chat` for a clear message
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningParam(_Lenient):
    effort: str | None = None  # "none" turns the template's thinking off; other values on


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningParam | None = None


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


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part_text(parts: str | list[InputPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    for j, p in enumerate(parts):
        if p.type not in SUPPORTED_PARTS:
            raise ApiError(
                400,
                f"content parts of type `{p.type}` are not supported: this server reads text only",
                param=f"{where}[{j}].type",
                code="unsupported_content",
            )
    return "".join(p.text for p in parts)


def input_messages(items: str | list[InputItem]) -> list[ChatMessage]:
    """`input` as chat messages; consecutive function_call items form one assistant turn."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)] if items else []
    out: list[ChatMessage] = []
    for i, it in enumerate(items):
        kind = it.type or ("message" if it.role else None)
        if kind == "message":
            if it.role is None:
                raise ApiError(400, "a message item needs a role", param=f"input[{i}].role")
            out.append(
                ChatMessage(role=it.role, content=_part_text(it.content, f"input[{i}].content"))
            )
        elif kind == "function_call":
            if not it.call_id or not it.name or it.arguments is None:
                raise ApiError(
                    400,
                    "a function_call item needs call_id, name and arguments",
                    param=f"input[{i}]",
                )
            call = ToolCall(
                id=it.call_id, function=ToolCallFunction(name=it.name, arguments=it.arguments)
            )
            if (
                out and out[-1].role == "assistant"
            ):  # the same assistant turn (text, then its calls)
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not it.call_id or it.output is None:
                raise ApiError(
                    400, "a function_call_output item needs call_id and output", param=f"input[{i}]"
                )
            out.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=it.call_id,
                    content=_part_text(it.output, f"input[{i}].output"),
                )
            )
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the template again (as chat does)
        else:
            raise ApiError(
                400,
                f"input items of type `{kind}` are not supported (message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    return out


def to_chat(
    body: ResponsesRequest, history: list[ChatMessage]
) -> tuple[ChatCompletionRequest, list[ChatMessage]]:
    """(the chat request, the conversation to store: history + input, without instructions)."""
    conv = [*history, *input_messages(body.input)]
    msgs = (
        [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    ) + conv
    if not msgs:
        raise ApiError(400, "input must not be empty", param="input")
    tools = None
    if body.tools:
        for i, t in enumerate(body.tools):
            if t.type != "function":
                raise ApiError(
                    400,
                    f"tools of type `{t.type}` are not supported: only function tools",
                    param=f"tools[{i}].type",
                )
        try:
            tools = [
                {
                    "type": "function",
                    "function": FunctionDef(
                        name=t.name,
                        description=t.description,
                        parameters=t.parameters,
                        strict=t.strict,
                    ),
                }
                for t in body.tools
            ]
        except ValidationError as e:
            raise ApiError(400, f"invalid tool: {e.errors()[0]['msg']}", param="tools") from None
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    response_format: dict[str, Any] | None = None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(
                400, "text.format of type json_schema needs a `schema`", param="text.format.schema"
            )
        response_format = {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name or "response",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            },
        }
    chat = ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": msgs,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls if body.tools else None,
            "response_format": response_format,
            "stream": body.stream,
        }
    )
    return chat, conv


def assistant_turn(text: str, calls: list[dict[str, Any]]) -> ChatMessage:
    return ChatMessage.model_validate(
        {"role": "assistant", "content": text or None, "tool_calls": calls or None}
    )


class _Builder:
    """The response object, before and after its output (shared by streamed and whole responses)."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id = _rid("resp")
        self.created = int(time.time())

    def obj(
        self, status: str, output: list[dict[str, Any]], result: ChatResult | None, store: bool
    ) -> dict[str, Any]:
        b = self.body
        usage = None
        if result is not None:
            usage = Usage(
                input_tokens=result.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
                output_tokens=result.output_tokens,
                total_tokens=result.prompt_tokens + result.output_tokens,
            ).model_dump()
        fmt = (
            b.text.format.model_dump(by_alias=True, exclude_none=True)
            if b.text
            else {"type": "text"}
        )
        choice = (
            b.tool_choice.model_dump()
            if isinstance(b.tool_choice, NamedFunction)
            else (b.tool_choice or "auto")
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
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


def status_of(result: ChatResult) -> str:
    return "incomplete" if result.finish == "length" else "completed"


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def router(st: ServerState, store: ResponseStore) -> APIRouter:
    r = APIRouter()

    @r.post(
        "/responses",
        responses={
            **json_or_stream("A response, or its typed events when streamed."),
            **error_responses(400, 401, 404, 413, 429, 500, 503),
        },
    )
    async def create(body: ResponsesRequest, raw: Request) -> Any:
        history: list[ChatMessage] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id)
            if prev is None:
                raise ApiError(
                    404,
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                )
            history = [ChatMessage.model_validate(m) for m in prev.conversation]
        chat, conv = to_chat(body, history)
        run = await start_chat(
            st, chat, "resp", thinking_of_effort(body.reasoning.effort if body.reasoning else None)
        )
        b = _Builder(body, st.settings.served_model_name)
        if not body.stream:
            result = await finish_chat(run, raw)
            if result is None:
                return JSONResponse({}, status_code=499)
            status = status_of(result)
            text = result.text or ""
            output: list[dict[str, Any]] = []
            if result.reasoning:
                output.append(
                    ReasoningItem(
                        id=_rid("rs"),
                        status=status,  # type: ignore[arg-type]
                        content=[ReasoningText(text=result.reasoning)],
                    ).model_dump()
                )
            if text or not result.calls:
                output.append(
                    MessageItem(
                        id=_rid("msg"),
                        status=status,  # type: ignore[arg-type]
                        content=[OutputText(text=text)],
                    ).model_dump()
                )
            output += [
                FunctionCallItem(
                    id=_rid("fc"),
                    call_id=c["id"],
                    name=c["function"]["name"],
                    arguments=c["function"]["arguments"],
                    status="completed",
                ).model_dump()
                for c in result.calls
            ]
            return _finish(b, status, output, result, conv + [assistant_turn(text, result.calls)])
        return StreamingResponse(
            _stream(b, run, conv),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _finish(
        b: _Builder,
        status: str,
        output: list[dict[str, Any]],
        result: ChatResult,
        conv: list[ChatMessage],
    ) -> dict[str, Any]:
        stored = b.body.store and store.put(
            b.id,
            b.obj(status, output, result, True),
            [m.model_dump(exclude_none=True) for m in conv],
        )
        return b.obj(status, output, result, stored)

    async def _stream(b: _Builder, run: Any, conv: list[ChatMessage]) -> AsyncIterator[str]:
        seq = 0
        output: list[dict[str, Any]] = []
        open_item: dict[str, Any] | None = (
            None  # the item being streamed (message or function_call)
        )
        text = ""  # the assistant turn, for the store
        calls: list[dict[str, Any]] = []

        def ev(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return _sse({"type": kind, "sequence_number": seq - 1, **fields})

        def close() -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            item, idx, open_item = open_item, len(output), None
            item["status"] = "completed"
            out: list[str] = []
            if item["type"] == "message":
                part = item["content"][0]
                out += [
                    ev(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=idx,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    ),
                    ev(
                        "response.content_part.done",
                        item_id=item["id"],
                        output_index=idx,
                        content_index=0,
                        part=part,
                    ),
                ]
            elif item["type"] == "reasoning":
                part = item["content"][0]
                out += [
                    ev(
                        "response.reasoning_text.done",
                        item_id=item["id"],
                        output_index=idx,
                        content_index=0,
                        text=part["text"],
                    ),
                    ev(
                        "response.content_part.done",
                        item_id=item["id"],
                        output_index=idx,
                        content_index=0,
                        part=part,
                    ),
                ]
            else:
                out.append(
                    ev(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=idx,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            output.append(item)
            out.append(ev("response.output_item.done", output_index=idx, item=item))
            return out

        def open_message(reasoning: bool = False) -> list[str]:
            nonlocal open_item
            if reasoning:
                open_item, part = (
                    ReasoningItem(id=_rid("rs"), status="in_progress", content=[]).model_dump(),
                    ReasoningText(text="").model_dump(),
                )
            else:
                open_item, part = (
                    MessageItem(id=_rid("msg"), status="in_progress", content=[]).model_dump(),
                    OutputText(text="").model_dump(),
                )
            frames = [
                ev(
                    "response.output_item.added",
                    output_index=len(output),
                    item=dict(open_item, content=[]),
                )
            ]
            open_item["content"] = [part]
            return frames + [
                ev(
                    "response.content_part.added",
                    item_id=open_item["id"],
                    output_index=len(output),
                    content_index=0,
                    part=dict(part),
                )
            ]

        yield ev("response.created", response=b.obj("in_progress", [], None, b.body.store))
        yield ev("response.in_progress", response=b.obj("in_progress", [], None, b.body.store))
        try:
            async for p in chat_pieces(run):
                if p.kind == "reasoning":
                    if open_item is None or open_item["type"] != "reasoning":
                        for f in close() + open_message(reasoning=True):
                            yield f
                    assert open_item is not None
                    open_item["content"][0]["text"] += p.text
                    yield ev(
                        "response.reasoning_text.delta",
                        item_id=open_item["id"],
                        output_index=len(output),
                        content_index=0,
                        delta=p.text,
                    )
                elif p.kind == "text":
                    if open_item is None or open_item["type"] != "message":
                        for f in close() + open_message():
                            yield f
                    assert open_item is not None
                    open_item["content"][0]["text"] += p.text
                    text += p.text
                    yield ev(
                        "response.output_text.delta",
                        item_id=open_item["id"],
                        output_index=len(output),
                        content_index=0,
                        delta=p.text,
                        logprobs=[],
                    )
                elif p.kind == "call":
                    for f in close():
                        yield f
                    open_item = FunctionCallItem(
                        id=_rid("fc"),
                        call_id=p.call_id,
                        name=p.name,
                        arguments="",
                        status="in_progress",
                    ).model_dump()
                    calls.append(
                        {
                            "id": p.call_id,
                            "type": "function",
                            "function": {"name": p.name, "arguments": ""},
                        }
                    )
                    yield ev(
                        "response.output_item.added", output_index=len(output), item=dict(open_item)
                    )
                    if p.text:
                        open_item["arguments"] += p.text
                        calls[-1]["function"]["arguments"] += p.text
                        yield ev(
                            "response.function_call_arguments.delta",
                            item_id=open_item["id"],
                            output_index=len(output),
                            delta=p.text,
                        )
                elif (
                    p.kind == "args"
                    and open_item is not None
                    and open_item["type"] == "function_call"
                ):
                    open_item["arguments"] += p.text
                    calls[-1]["function"]["arguments"] += p.text
                    yield ev(
                        "response.function_call_arguments.delta",
                        item_id=open_item["id"],
                        output_index=len(output),
                        delta=p.text,
                    )
                elif p.kind == "end":
                    assert p.result is not None
                    if not any(
                        i["type"] != "reasoning"
                        for i in output + ([open_item] if open_item else [])
                    ):
                        # no message or call: an empty output is still one (empty) message
                        for f in close() + open_message():
                            yield f
                    for f in close():
                        yield f
                    status = status_of(p.result)
                    if status == "incomplete":
                        for item in output:
                            item["status"] = "incomplete"
                    final = _finish(
                        b, status, output, p.result, conv + [assistant_turn(text, calls)]
                    )
                    yield ev(f"response.{status}", response=final)
        except StreamFailed as e:
            failed = b.obj("failed", output, None, False)
            failed["error"] = {"code": "server_error", "message": e.message}
            yield ev("error", code=e.code, message=e.message, param=None)
            yield ev("response.failed", response=failed)
        finally:  # a client that went away: its sequence is aborted now, not when the generator is collected
            run.choices.abort_unfinished()

    @r.get("/responses/{response_id}", responses=error_responses(401, 404))
    async def retrieve(response_id: str) -> Any:
        item = store.get(response_id)
        if item is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
        return item.response

    @r.delete("/responses/{response_id}", responses=error_responses(401, 404))
    async def delete(response_id: str) -> Any:
        if not store.delete(response_id):
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return r
