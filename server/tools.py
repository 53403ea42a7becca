"""Tool calls: what the output is constrained to, and how it is parsed back into `tool_calls`.

- tool_choice "required": the output is constrained to a JSON array of one or more calls,
  `[{"name": <one of the tools>, "arguments": {...its parameters...}}]` (vLLM's form).
- a named function: the output is constrained to that function's arguments object; the call
  is that object.  Streams can then send the arguments as they are generated.
- "auto": nothing is constrained; calls written in the Hermes/Qwen style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` are parsed out of the text.
- "none": tools are shown to the chat template, and the output is plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from engine import ConstraintSpec
from server.errors import ApiError
from server.protocol import ChatCompletionRequest, FunctionName, NamedToolChoice, Tool

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


def _params(t: Tool) -> dict[str, Any]:
    return t.function.parameters or {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """How one chat request uses tools; `kind` is none | auto | required | named."""

    kind: str
    named: str | None = None

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")


def tool_mode(body: ChatCompletionRequest) -> ToolMode:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(
                400, "tool_choice is only allowed when tools are specified", param="tool_choice"
            )
        return ToolMode("none")
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool function names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names the function `{choice.function.name}`, which is not in tools",
                param="tool_choice",
            )
        return ToolMode("named", choice.function.name)
    return ToolMode(choice or "auto")


def forced_body(
    body: ChatCompletionRequest, forced: tuple[tuple[str, dict[str, Any] | None], ...]
) -> ChatCompletionRequest | None:
    """--force-tool-call: the request as if it named the first forced tool it offers, when it
    holds no tool result yet (so a conversation gets one forced call, then answers).  Pinned
    arguments replace that tool's schema with one admitting only them.  None: not forced."""
    if not body.tools or any(m.role == "tool" for m in body.messages):
        return None
    offered = {t.function.name for t in body.tools}
    name, pinned = next(((n, a) for n, a in forced if n in offered), (None, None))
    if name is None:
        return None
    tools = [
        t.model_copy(
            update={"function": t.function.model_copy(update={"parameters": {"const": pinned}})}
        )
        if t.function.name == name and pinned is not None
        else t
        for t in body.tools
    ]
    choice = NamedToolChoice(type="function", function=FunctionName(name=name))
    return body.model_copy(update={"tools": tools, "tool_choice": choice})


def tool_constraint(body: ChatCompletionRequest, mode: ToolMode) -> ConstraintSpec | None:
    assert body.tools is not None or not mode.constrained
    if mode.kind == "named":
        tool = next(t for t in body.tools or [] if t.function.name == mode.named)
        return ConstraintSpec.json_schema(_params(tool), kind="tool_calls")
    if mode.kind == "required":
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _params(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in body.tools or []
        ]
        items: dict[str, Any] = call[0] if len(call) == 1 else {"anyOf": call}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ConstraintSpec.json_schema(schema, kind="tool_calls")
    return None


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_calls(
    text: str, mode: ToolMode, tool_names: list[str]
) -> tuple[str | None, list[dict[str, Any]]]:
    """(remaining content, calls) from a finished output."""
    if mode.kind == "named":
        assert mode.named is not None
        return None, [new_call(mode.named, text)]
    if mode.kind == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short by max_tokens: no call can be claimed
        return None, [
            new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls
        ]
    if mode.kind == "auto":
        calls = []
        for m in _HERMES.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("name") in tool_names:
                args = obj.get("arguments", obj.get("parameters", {}))
                calls.append(
                    new_call(
                        obj["name"],
                        args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    )
                )
        if calls:
            rest = _HERMES.sub("", text).strip()
            return rest or None, calls
    return text, []


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them (tool-call arguments as objects, like vLLM)."""
    out = []
    for m in body.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _maybe_json(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def _maybe_json(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [
        {"type": "function", "function": t.function.model_dump(exclude_none=True)}
        for t in body.tools
    ]


def _open_overlap(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of TOOL_CALL_OPEN."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:n]):
            return n
    return 0


class ToolStream:
    """Streams one choice of a request with tools: text deltas while they cannot be part of a
    call, then `delta.tool_calls` (a named function streams its arguments as they come)."""

    def __init__(self, mode: ToolMode, tool_names: list[str]) -> None:
        self.mode, self.tool_names = mode, tool_names
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.call_id: str | None = None

    def feed(self, piece: str) -> dict[str, Any]:
        """The delta for new text (possibly empty)."""
        self.text += piece
        if self.mode.kind == "named":
            assert self.mode.named is not None
            if self.call_id is None:
                self.call_id = new_call(self.mode.named, "")["id"]
                return {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": self.call_id,
                            "type": "function",
                            "function": {"name": self.mode.named, "arguments": piece},
                        }
                    ]
                }
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
        if self.mode.kind != "auto":
            return {}  # required: a JSON array, parsed once complete
        start = self.text.find(TOOL_CALL_OPEN)
        safe = start if start >= 0 else len(self.text) - _open_overlap(self.text)
        out = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return {"content": out} if out else {}

    def finish(self) -> tuple[dict[str, Any], bool]:
        """The last delta once the choice ended, and whether it holds tool calls."""
        if self.mode.kind == "named":
            return {}, self.call_id is not None
        content, calls = parse_calls(self.text[self.sent :], self.mode, self.tool_names)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return delta, bool(calls)
