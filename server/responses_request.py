"""A /v1/responses request as a chat request (the shared chat path, server/chat_bridge.py).

`instructions` is a system message; `input` items become messages (function_call items an
assistant's tool_calls, function_call_output items tool messages); `text.format` becomes
response_format; function tools become chat tools.  A `namespace` tool (a named group of
functions, as Codex sends) is flattened: the model sees `NAMESPACE__NAME`, and a call comes
back as `name` NAME with `namespace` NAMESPACE, the way the client defined it.  Hosted tools
the server cannot run (web_search, file_search, ...) are left out of what the model sees and
named in a log line, never refused: an agent that offers them still gets its turn.
Unknown fields are accepted and ignored.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.errors import ApiError
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    ToolCall,
    ToolCallFunction,
)

log = logging.getLogger("moe_offload.server")
SUPPORTED_PARTS = ("input_text", "output_text", "text")
NAMESPACE_SEP = "__"  # Codex's own flat spelling of a namespaced function


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
    namespace: str | None = None  # a function_call of a namespaced function
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(_Lenient):
    type: str  # function and namespace are served, hosted tools dropped (`chat_tools`)
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's functions


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str
    namespace: str | None = None


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


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for function `name` of `namespace` (Codex's canonical form)."""
    if not namespace:
        return name
    return f"{namespace.rstrip('_')}{NAMESPACE_SEP}{name.lstrip('_')}"


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
            text = _part_text(it.content, f"input[{i}].content")
            out.append(ChatMessage(role=it.role, content=text))
        elif kind == "function_call":
            if not it.call_id or not it.name or it.arguments is None:
                raise ApiError(
                    400,
                    "a function_call item needs call_id, name and arguments",
                    param=f"input[{i}]",
                )
            fn = ToolCallFunction(name=flat_name(it.namespace, it.name), arguments=it.arguments)
            call = ToolCall(id=it.call_id, function=fn)
            if out and out[-1].role == "assistant":  # the same assistant turn (text, then calls)
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not it.call_id or it.output is None:
                raise ApiError(
                    400, "a function_call_output item needs call_id and output", param=f"input[{i}]"
                )
            text = _part_text(it.output, f"input[{i}].output")
            out.append(ChatMessage(role="tool", tool_call_id=it.call_id, content=text))
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the template again (as chat does)
        else:
            raise ApiError(
                400,
                f"input items of type `{kind}` are not supported (message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    return out


def chat_tools(
    tools: list[FunctionTool] | None,
) -> tuple[list[dict[str, Any]] | None, dict[str, tuple[str, str]], list[str]]:
    """(chat tools, {flat name: (namespace, name)} of namespaced functions, dropped tool types)."""
    if not tools:
        return None, {}, []
    out: list[dict[str, Any]] = []
    spaced: dict[str, tuple[str, str]] = {}
    dropped: list[str] = []
    for i, t in enumerate(tools):
        if t.type == "function":
            members, ns = [(t, f"tools[{i}]")], None
        elif t.type == "namespace":
            ns = t.name
            members = [(f, f"tools[{i}].tools[{j}]") for j, f in enumerate(t.tools or [])]
        else:  # hosted: web_search, file_search, computer_use, code_interpreter, mcp, ...
            dropped.append(t.type)
            continue
        for f, where in members:
            name = flat_name(ns, f.name)
            if ns is not None:
                spaced[name] = (ns, f.name)
            try:
                fn = FunctionDef(
                    name=name, description=f.description, parameters=f.parameters, strict=f.strict
                )
            except ValidationError as e:
                raise ApiError(400, f"invalid tool: {e.errors()[0]['msg']}", param=where) from None
            out.append({"type": "function", "function": fn})
    if dropped:
        log.warning("responses: hosted tools this server cannot run were left out: %s", dropped)
    return out or None, spaced, dropped


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(
                400, "text.format of type json_schema needs a `schema`", param="text.format.schema"
            )
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name or "response",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            },
        }
    return None


def to_chat(
    body: ResponsesRequest, history: list[ChatMessage]
) -> tuple[ChatCompletionRequest, list[ChatMessage], dict[str, tuple[str, str]]]:
    """(the chat request, the conversation to store: history + input without instructions,
    {flat name: (namespace, name)} of the namespaced functions)."""
    conv = [*history, *input_messages(body.input)]
    msgs = (
        [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    ) + conv
    if not msgs:
        raise ApiError(400, "input must not be empty", param="input")
    tools, spaced, _ = chat_tools(body.tools)
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {
            "type": "function",
            "function": {"name": flat_name(choice.namespace, choice.name)},
        }
    chat = ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": msgs,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": tools,
            "tool_choice": choice if tools or not body.tools else None,  # None: only hosted tools
            "parallel_tool_calls": body.parallel_tool_calls if tools else None,
            "response_format": _response_format(body),
            "stream": body.stream,
        }
    )
    return chat, conv, spaced


def assistant_turn(text: str, calls: list[dict[str, Any]]) -> ChatMessage:
    return ChatMessage.model_validate(
        {"role": "assistant", "content": text or None, "tool_calls": calls or None}
    )
