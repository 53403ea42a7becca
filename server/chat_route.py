"""POST /v1/chat/completions: validate, template, submit, then the whole answer or its chunks.

The Responses and Anthropic Messages routes reuse its checks (server/chat_bridge.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from engine import ConstraintSpec, check_spec
from server.errors import ApiError
from server.formatting import Accumulated, chat_logprobs
from server.protocol import ChatCompletionRequest, new_id, now, usage
from server.reasoning import ReasoningSplitter, reasoning_prompt, split_whole, thinking_of_effort
from server.routes import collect, sse_response, stream_events
from server.state import Choices, ServerState
from server.tools import ToolMode, ToolStream, parse_calls, tool_constraint, tool_mode


async def chat_constraint(
    st: ServerState, body: ChatCompletionRequest, mode: ToolMode
) -> ConstraintSpec | None:
    """The grammar a chat request's output must follow, checked here so a bad schema is a 400."""
    fmt = body.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if mode.constrained and wants_json:
        raise ApiError(
            400,
            "response_format cannot be combined with a tool_choice that forces a call",
            param="response_format",
        )
    if mode.constrained:
        spec, param = tool_constraint(body, mode), "tools"
    elif fmt is not None and fmt.type == "json_object":
        spec, param = ConstraintSpec("json_object"), "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        spec, param = (
            ConstraintSpec.json_schema(fmt.json_schema.schema_),
            "response_format.json_schema.schema",
        )
    else:
        return None
    assert spec is not None
    if body.ignore_eos:
        raise ApiError(
            400,
            "ignore_eos cannot be combined with structured output (the grammar ends the output)",
            param="ignore_eos",
        )
    if (err := await st.off_loop(check_spec, spec)) is not None:
        raise ApiError(400, f"invalid schema: {err}", param=param)
    return spec


def check_messages(st: ServerState, body: ChatCompletionRequest) -> None:
    if len(body.messages) > st.settings.server.max_messages:
        raise ApiError(
            400, f"at most {st.settings.server.max_messages} messages per request", param="messages"
        )
    for i, m in enumerate(body.messages):
        if (bad := m.unsupported_part()) is not None:
            raise ApiError(
                400,
                f"content parts of type `{bad[1]}` are not supported: this server reads text only",
                param=f"messages[{i}].content[{bad[0]}].type",
                code="unsupported_content",
            )
    st.check_text_length(sum(len(m.text()) for m in body.messages), "messages")


@dataclass
class _ChatCall:
    """A submitted chat request: what both the whole answer and the stream are built from."""

    body: ChatCompletionRequest
    prompt: list[int]
    choices: Choices
    lp: int | None  # top logprobs per token, None: no logprobs
    reasoning: bool  # the <think> section goes to reasoning_content
    inside: bool  # the prompt already opened the <think> section
    mode: ToolMode
    names: list[str]  # the request's tool names
    rid: str
    created: int = field(default_factory=now)

    @property
    def parse_tools(self) -> bool:
        return self.mode.kind != "none"

    def envelope(self, model: str, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": model}


async def chat_completions(st: ServerState, body: ChatCompletionRequest, raw: Request) -> Any:
    st.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    check_messages(st, body)
    st.check_accepting(body.n)  # refuse early (draining, queue full) before any tokenizing
    mode = tool_mode(body)
    constraint = await chat_constraint(st, body, mode)
    prompt, reasoning, inside = await reasoning_prompt(
        st, body, thinking_of_effort(body.reasoning_effort)
    )
    reasoning = reasoning and constraint is None  # a grammar-constrained output has no <think>
    lp = (body.top_logprobs or 0) if body.logprobs else None
    rid = new_id("chatcmpl")
    choices = st.submit(
        st.make_requests(rid, [prompt], body, body.token_limit(), lp, None, constraint)
    )
    call = _ChatCall(
        body=body,
        prompt=prompt,
        choices=choices,
        lp=lp,
        reasoning=reasoning,
        inside=inside,
        mode=mode,
        names=[t.function.name for t in body.tools or []],
        rid=rid,
    )
    if not body.stream:
        accs = await collect(call.choices, raw)
        if accs is None:
            return JSONResponse({}, status_code=499)
        return _whole_chat(st, call, accs)
    stream = _ChatStream(st, call)
    return sse_response(stream_events(call.choices, stream.chunk, stream.final))


def _whole_chat(st: ServerState, call: _ChatCall, accs: list[Accumulated]) -> dict[str, Any]:
    """The non-streamed chat.completion: each choice's message, tool calls and reasoning."""
    out = []
    for i, a in enumerate(accs):
        thought, text = split_whole(a.text, call.inside) if call.reasoning else ("", a.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = a.finish_reason
        if call.parse_tools:
            content, calls = parse_calls(text, call.mode, call.names)
            message = {
                "role": "assistant",
                "content": content,
                **({"tool_calls": calls} if calls else {}),
            }
            if calls and finish == "stop":
                finish = "tool_calls"
        if call.reasoning:
            message["reasoning_content"] = thought or None
        out.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(a.logprobs, st.token_text)
                if call.lp is not None
                else None,
                "finish_reason": finish,
            }
        )
    return {
        **call.envelope(st.settings.served_model_name, "chat.completion"),
        "choices": out,
        "usage": usage(
            len(call.prompt),
            sum(a.num_output_tokens for a in accs),
            max(a.num_cached_tokens for a in accs),
        ),
    }


class _ChatStream:
    """The chat.completion.chunk of each engine output, per choice: the role first, then text,
    reasoning and tool-call deltas; with include_usage a last chunk with the usage."""

    def __init__(self, st: ServerState, call: _ChatCall) -> None:
        self.st, self.call = st, call
        k = len(call.choices.rids)
        self.n_out, self.n_cached = [0] * k, [0] * k
        self.extra = {"usage": None} if call.body.include_usage() else {}
        self.tools = (
            [ToolStream(call.mode, call.names) for _ in range(k)] if call.parse_tools else None
        )
        self.thinks = [ReasoningSplitter(call.inside) for _ in range(k)] if call.reasoning else None

    def _envelope(self) -> dict[str, Any]:
        return self.call.envelope(self.st.settings.served_model_name, "chat.completion.chunk")

    def chunk(self, i: int, o: Any) -> dict[str, Any] | None:
        lp = self.call.lp
        if o is None:  # opening chunk: the role, once per choice
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
            lps = None
            finish = None
        else:
            self.n_out[i], self.n_cached[i] = o.num_output_tokens, o.num_cached_tokens
            delta, finish = self._delta(i, o)
            if not delta and not finish and not (lp is not None and o.token_ids):
                return None
            lps = chat_logprobs(o.logprobs or [], self.st.token_text) if lp is not None else None
        c = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish}
        return {**self._envelope(), "choices": [c], **self.extra}

    def _delta(self, i: int, o: Any) -> tuple[dict[str, Any], str | None]:
        """Choice i's delta for output `o` (text, reasoning, tool calls) and its finish reason."""
        finish, text, thought = o.finish_reason, o.text, ""
        if self.thinks is not None:  # the <think> section's text goes to delta.reasoning_content
            thought, text = self.thinks[i].feed(o.text)
            if finish is not None:
                r2, c2 = self.thinks[i].finish()
                thought, text = thought + r2, text + c2
        if self.tools is not None:
            delta = self.tools[i].feed(text)
            if finish is not None:
                last, has_calls = self.tools[i].finish()
                for k, v in last.items():  # content and tool_calls of the final piece
                    delta[k] = delta.get(k, []) + v if k == "tool_calls" else delta.get(k, "") + v
                if has_calls and finish == "stop":
                    finish = "tool_calls"
        else:
            delta = {"content": text} if text else {}
        if thought:
            delta = {"reasoning_content": thought, **delta}
        return delta, finish

    def final(self) -> dict[str, Any] | None:
        if not self.call.body.include_usage():
            return None
        return {
            **self._envelope(),
            "choices": [],
            "usage": usage(len(self.call.prompt), sum(self.n_out), max(self.n_cached)),
        }
