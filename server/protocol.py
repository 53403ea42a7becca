"""OpenAI request bodies (pydantic; unknown fields are accepted and ignored) and id helpers.

Values are checked strictly against their JSON types (no "5" for 5, no 1 for true), so the
OpenAPI document's types are the truth. The ranges are OpenAI's: temperature in [0, 2] (below
1e-5 it means greedy), top_p in (0, 1], penalties in [-2, 2]; anything outside is a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator


def _whole(v: Any) -> Any:
    """JSON Schema's integer includes 2.0: accept a float with no fraction as the int."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_whole)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False


class ContentPart(_Lenient):
    """A content part; only "text" can be honoured (routes answer 400 for image/audio/file parts)."""

    type: str = "text"
    text: str = ""


class ToolCallFunction(_Lenient):
    name: str
    arguments: str = ""


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (history)
    tool_call_id: str | None = None  # a tool result answers this call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content if p.type == "text")

    def unsupported_part(self) -> tuple[int, str] | None:
        """(index, type) of the first content part this text-only server cannot read."""
        if isinstance(self.content, list):
            for j, p in enumerate(self.content):
                if p.type != "text":
                    return j, p.type
        return None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Lenient):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    # Unknown types are a 400 naming response_format.type (never silently ignored).
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a `json_schema` object")
        return self


class _SamplingFields(_Lenient):
    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM spells "off" as -1)
    n: Int = Field(default=1, ge=1, le=16)
    # At most 16 (checked by _stops, so that an error names `stop`); the schema says so too.
    stop: str | list[str] | None = Field(
        default=None,
        json_schema_extra={
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "maxItems": 16},
                {"type": "null"},
            ]
        },
    )
    seed: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")  # as OpenAI
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return tuple(s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # "none" turns a template's thinking off (enable_thinking)

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


TokenId = Annotated[Int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
# A prompt: text, a batch of texts, token ids, or a batch of token id lists (none of them empty).
PromptType = (
    Text
    | Annotated[list[Text], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    max_tokens: Int | None = Field(
        default=16, ge=0
    )  # OpenAI's default; 0 only with echo (prompt logprobs)
    suffix: str | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage; prompt_tokens_details.cached_tokens: prompt tokens read from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
