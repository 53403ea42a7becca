"""A /v1/messages (or count_tokens) request as a chat request (server/chat_bridge.py).

`system` and any `{"role": "system"}` message inside `messages` (Claude Code sends one) are
merged, in order, into one system message at the start; a user turn's tool_result blocks
become tool messages (before its text), an assistant turn's tool_use blocks its tool_calls;
`tools[].input_schema` are the functions' parameters; tool_choice auto / any / tool / none map
to chat's auto / required / named / none, and disable_parallel_tool_use to
parallel_tool_calls=false.  stop_sequences, temperature, top_p and top_k are chat's stop,
temperature, top_p and top_k.  `thinking` enabled / adaptive turns the template's thinking on,
disabled off.  Tools the server cannot run (Anthropic's server tools, schema-less typed tools
such as web_search_20250305) are left out of what the model sees and named in a log line,
never refused.  Unknown fields (context_management, output_config, ...) are accepted and
ignored.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.errors import ApiError, client_line
from server.protocol import ChatCompletionRequest, ChatMessage

log = logging.getLogger("moe_offload.server")


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
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ATool(_Lenient):
    type: str | None = None  # absent or "custom": a client tool; others are dropped
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of a client tool


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


def _tool_call(b: Block, where: str) -> dict[str, Any]:
    if not b.id or not b.name:
        raise ApiError(400, f"{where}: a tool_use block needs id and name")
    arguments = json.dumps(b.input or {}, ensure_ascii=False)
    return {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}}


def _turn(role: str, blocks: list[Block], i: int) -> list[ChatMessage]:
    """One user or assistant turn of content blocks: its tool messages, then the turn itself."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "tool_use" and role == "assistant":
            calls.append(_tool_call(b, where))
        elif b.type == "tool_result" and role == "user":
            if not b.tool_use_id:
                raise ApiError(400, f"{where}: a tool_result block needs tool_use_id")
            result = _text(b.content, f"{where}.content")
            out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=result))
        elif b.type in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the template again
        else:
            raise ApiError(
                400,
                f"{where}: blocks of type `{b.type}` are not supported in a {role} turn (text, tool_use, tool_result)",
            )
    if texts or calls or not any(b.type == "tool_result" for b in blocks):
        content = "".join(texts) if texts or not calls else None
        turn = {"role": role, "content": content, "tool_calls": calls or None}
        out.append(ChatMessage.model_validate(turn))
    return out


def chat_messages(body: _Body) -> list[ChatMessage]:
    systems = [_text(body.system, "system")] if body.system else []
    out: list[ChatMessage] = []
    for i, m in enumerate(body.messages):
        if m.role == "system":
            systems.append(_text(m.content, f"messages.{i}.content"))
        elif isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
        else:
            out += _turn(m.role, m.content, i)
    if systems:
        out.insert(0, ChatMessage(role="system", content="\n\n".join(s for s in systems if s)))
    return out


def chat_tools(tools: list[ATool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    dropped = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            dropped.append(t.type)
            continue
        if t.input_schema is None:
            raise ApiError(400, f"tools.{i}.input_schema: a client tool needs an input_schema")
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        out.append({"type": "function", "function": fn})
    if dropped:
        log.warning("messages: tools this server cannot run were left out: %s", dropped)
    return out or None


def to_chat(
    body: _Body, max_tokens: int | None = None, stream: bool = False
) -> ChatCompletionRequest:
    tools = chat_tools(body.tools)
    choice: Any = None
    parallel = None
    if body.tool_choice is not None and (tools or not body.tools):  # not: only hosted tools
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
        raise ApiError(400, f"invalid request: {client_line(e)}") from None
