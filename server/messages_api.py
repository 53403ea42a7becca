"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.

A request becomes a chat request (server/chat_bridge.py): `system` is a system message; a
user turn's tool_result blocks become tool messages (before its text), an assistant turn's
tool_use blocks its tool_calls; `tools[].input_schema` are the functions' parameters;
tool_choice auto / any / tool / none map to chat's auto / required / named / none, and
disable_parallel_tool_use to parallel_tool_calls=false.  stop_sequences, temperature, top_p
and top_k are chat's stop, temperature, top_p and top_k.

usage.input_tokens excludes the prompt tokens read from the prefix cache, which are
cache_read_input_tokens (as Anthropic defines them); count_tokens counts the whole prompt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from server.anthropic_errors import AnthropicRoute, anthropic_sse_error
from server.chat_bridge import (
    ChatResult,
    StreamFailed,
    chat_pieces,
    finish_chat,
    start_chat,
)
from server.errors import ApiError
from server.openapi import AnthropicErrorResponse, error_responses, json_or_stream
from server.protocol import ChatCompletionRequest, ChatMessage
from server.reasoning import reasoning_prompt
from server.routes import _check_messages
from server.state import ServerState
from server.tools import tool_mode


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Lenient):
    """A content block: text, tool_use (id, name, input) or tool_result (tool_use_id, content)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class AMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ATool(_Lenient):
    type: str | None = None  # absent or "custom": a client tool; server tools are refused
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted; the template's switch is on or off


class _Body(_Lenient):
    model: str
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: ThinkingParam | None = None

    def thinking_switch(self) -> bool | None:
        return None if self.thinking is None else self.thinking.type != "disabled"


class CountTokensRequest(_Body):
    pass


class MessagesRequest(_Body):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None


def _text(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, b in enumerate(content):
        if b.type != "text":
            raise ApiError(
                400, f"{where}[{j}]: blocks of type `{b.type}` are not supported here (text only)"
            )
    return "".join(b.text or "" for b in content)


def chat_messages(body: _Body) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if body.system:
        out.append(ChatMessage(role="system", content=_text(body.system, "system")))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise ApiError(400, f"{where}: a tool_use block needs id and name")
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {
                            "name": b.name,
                            "arguments": json.dumps(b.input or {}, ensure_ascii=False),
                        },
                    }
                )
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise ApiError(400, f"{where}: a tool_result block needs tool_use_id")
                out.append(
                    ChatMessage(
                        role="tool",
                        tool_call_id=b.tool_use_id,
                        content=_text(b.content, f"{where}.content"),
                    )
                )
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not shown to the template again
            else:
                raise ApiError(
                    400,
                    f"{where}: blocks of type `{b.type}` are not supported in a {m.role} turn (text, tool_use, tool_result)",
                )
        if texts or calls or not any(b.type == "tool_result" for b in m.content):
            out.append(
                ChatMessage.model_validate(
                    {
                        "role": m.role,
                        "content": "".join(texts) if texts or not calls else None,
                        "tool_calls": calls or None,
                    }
                )
            )
    return out


def to_chat(
    body: _Body, max_tokens: int | None = None, stream: bool = False
) -> ChatCompletionRequest:
    tools = None
    if body.tools:
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise ApiError(
                    400,
                    f"tools.{i}: server tools of type `{t.type}` are not supported: only client tools with input_schema",
                )
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    choice: Any = None
    parallel = None
    if body.tool_choice is not None:
        tc = body.tool_choice
        if tc.type == "tool":
            if not tc.name:
                raise ApiError(400, "tool_choice of type tool needs a name")
            choice = {"type": "function", "function": {"name": tc.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        parallel = False if tc.disable_parallel_tool_use else None
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if isinstance(body, MessagesRequest):
        fields.update(
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as e:
        raise ApiError(400, f"invalid request: {e}") from None


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


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input_of(arguments: str) -> dict[str, Any]:
    try:
        v = json.loads(arguments)
    except json.JSONDecodeError:
        return {}  # cut short by max_tokens: no arguments can be claimed
    return v if isinstance(v, dict) else {}


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def router(st: ServerState) -> APIRouter:
    r = APIRouter(route_class=AnthropicRoute)
    model = st.settings.served_model_name

    @r.post(
        "/messages",
        responses={
            **json_or_stream("A message, or its events when streamed."),
            **error_responses(400, 401, 404, 413, 429, 500, 503, 529, model=AnthropicErrorResponse),
        },
    )
    async def create(body: MessagesRequest, raw: Request) -> Any:
        run = await start_chat(
            st, to_chat(body, body.max_tokens, body.stream), "msg", body.thinking_switch()
        )
        mid = f"msg_{uuid.uuid4().hex}"
        if not body.stream:
            res = await finish_chat(run, raw)
            if res is None:
                return JSONResponse({}, status_code=499)
            content: list[dict[str, Any]] = (
                [{"type": "thinking", "thinking": res.reasoning, "signature": ""}]
                if res.reasoning
                else []
            )
            content += (
                [{"type": "text", "text": res.text or ""}] if res.text or not res.calls else []
            )
            content += [
                {
                    "type": "tool_use",
                    "id": _tool_id(c["id"]),
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
        return StreamingResponse(
            _stream(run, mid),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _stream(run: Any, mid: str) -> AsyncIterator[str]:
        def start() -> str:
            # Sent with the first piece: by then the engine has said how much of the prompt was cached.
            u = {
                "input_tokens": len(run.prompt) - run.cached,
                "output_tokens": 0,
                "cache_read_input_tokens": run.cached,
                "cache_creation_input_tokens": 0,
            }
            return _sse(
                "message_start",
                {
                    "message": {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": u,
                    }
                },
            )

        started = False
        index, open_kind = -1, None  # the content block being streamed
        saw_answer = False  # a text or tool_use block was opened
        try:
            async for p in chat_pieces(run):
                if not started:
                    started = True
                    yield start()
                if p.kind == "wait":
                    yield _sse("ping", {})
                elif p.kind == "reasoning":
                    if open_kind != "thinking":
                        if open_kind is not None:
                            yield _sse("content_block_stop", {"index": index})
                        index, open_kind = index + 1, "thinking"
                        yield _sse(
                            "content_block_start",
                            {
                                "index": index,
                                "content_block": {
                                    "type": "thinking",
                                    "thinking": "",
                                    "signature": "",
                                },
                            },
                        )
                    yield _sse(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "thinking_delta", "thinking": p.text}},
                    )
                elif p.kind == "text":
                    saw_answer = True
                    if open_kind != "text":
                        if open_kind is not None:
                            yield _sse("content_block_stop", {"index": index})
                        index, open_kind = index + 1, "text"
                        yield _sse(
                            "content_block_start",
                            {"index": index, "content_block": {"type": "text", "text": ""}},
                        )
                    yield _sse(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "text_delta", "text": p.text}},
                    )
                elif p.kind == "call":
                    saw_answer = True
                    if open_kind is not None:
                        yield _sse("content_block_stop", {"index": index})
                    index, open_kind = index + 1, "tool_use"
                    yield _sse(
                        "content_block_start",
                        {
                            "index": index,
                            "content_block": {
                                "type": "tool_use",
                                "id": _tool_id(p.call_id),
                                "name": p.name,
                                "input": {},
                            },
                        },
                    )
                    if p.text:
                        yield _sse(
                            "content_block_delta",
                            {
                                "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": p.text},
                            },
                        )
                elif p.kind == "args" and open_kind == "tool_use":
                    yield _sse(
                        "content_block_delta",
                        {
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": p.text},
                        },
                    )
                elif p.kind == "end":
                    assert p.result is not None
                    if (
                        open_kind in (None, "thinking") and not saw_answer
                    ):  # an empty answer is still one (empty) text block
                        if open_kind is not None:
                            yield _sse("content_block_stop", {"index": index})
                        index, open_kind = index + 1, "text"
                        yield _sse(
                            "content_block_start",
                            {"index": index, "content_block": {"type": "text", "text": ""}},
                        )
                    yield _sse("content_block_stop", {"index": index})
                    u = usage_of(p.result)
                    yield _sse(
                        "message_delta",
                        {
                            "delta": {
                                "stop_reason": stop_reason(p.result),
                                "stop_sequence": p.result.stop_sequence,
                            },
                            "usage": u,
                        },
                    )
                    yield _sse("message_stop", {})
        except StreamFailed as e:
            if not started:
                yield start()
            yield anthropic_sse_error(e.status, e.message)
        finally:  # a client that went away: its sequence is aborted now, not when the generator is collected
            run.choices.abort_unfinished()

    @r.post(
        "/messages/count_tokens",
        responses=error_responses(400, 401, 404, 413, 500, 503, model=AnthropicErrorResponse),
    )
    async def count_tokens(body: CountTokensRequest) -> Any:
        chat = to_chat(body)
        st.check_model(chat.model)
        _check_messages(st, chat)  # the same limits as a real call
        tool_mode(chat)  # and the same tool checks
        prompt, _, _ = await reasoning_prompt(st, chat, body.thinking_switch())
        return {"input_tokens": len(prompt)}

    return r
