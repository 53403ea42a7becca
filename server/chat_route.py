"""POST /v1/chat/completions: validate, template, submit, then the whole answer or its chunks.

The Responses and Anthropic Messages routes submit through `submit_chat` too and take their
outputs apart with `whole_output` and `OutputSplit` (server/chat_bridge.py)."""

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
from server.tools import ToolMode, ToolStream, forced_body, parse_calls, tool_constraint, tool_mode


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
class ChatRun:
    """A submitted chat request: what both the whole answer and the stream are built from."""

    body: ChatCompletionRequest
    rid: str
    choices: Choices
    prompt: list[int]
    mode: ToolMode
    tool_names: list[str]  # the request's tool names
    reasoning: bool  # the <think> section goes to reasoning_content
    inside: bool  # the prompt already opened the <think> section
    lp: int | None  # top logprobs per token, None: no logprobs
    created: int = field(default_factory=now)
    cached: int = 0  # prompt tokens read from the prefix cache (a bridged stream's, once known)

    @property
    def parse_tools(self) -> bool:
        return self.mode.kind != "none"

    def envelope(self, model: str, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": model}


async def submit_chat(
    st: ServerState,
    body: ChatCompletionRequest,
    id_prefix: str,
    thinking: bool | None,
    forced_tools: bool = False,
) -> ChatRun:
    """Validate, template and submit `body`; `forced_tools`: --force-tool-call applies (the
    Responses and Messages APIs)."""
    st.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    check_messages(st, body)
    st.check_accepting(body.n)  # refuse early (draining, queue full) before any tokenizing
    mode = tool_mode(body)
    # The prompt shows the tools as sent; a forced call only changes what the output may be.
    forced = forced_body(body, st.settings.forced_tools) if forced_tools else None
    if forced is not None:
        mode = tool_mode(forced)
    constraint = await chat_constraint(st, forced or body, mode)
    prompt, reasoning, inside = await reasoning_prompt(st, body, thinking)
    lp = (body.top_logprobs or 0) if body.logprobs else None
    rid = new_id(id_prefix)
    choices = st.submit(
        st.make_requests(rid, [prompt], body, body.token_limit(), lp, None, constraint)
    )
    return ChatRun(
        body=body,
        rid=rid,
        choices=choices,
        prompt=prompt,
        mode=mode,
        tool_names=[t.function.name for t in body.tools or []],
        reasoning=reasoning and constraint is None,  # a grammar-constrained output has no <think>
        inside=inside,
        lp=lp,
    )


def whole_output(run: ChatRun, text: str) -> tuple[str, str | None, list[dict[str, Any]]]:
    """A finished output taken apart: (the <think> section's text, the content left, tool calls)."""
    thought, content = split_whole(text, run.inside) if run.reasoning else ("", text)
    if not run.parse_tools:
        return thought, content, []
    left, calls = parse_calls(content, run.mode, run.tool_names)
    return thought, left, calls


class OutputSplit:
    """One choice's output taken apart as it streams: the <think> section's text, and the content
    and tool-call deltas (chat-completions form)."""

    def __init__(self, run: ChatRun) -> None:
        self.think = ReasoningSplitter(run.inside) if run.reasoning else None
        self.tools = ToolStream(run.mode, run.tool_names) if run.parse_tools else None

    def feed(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]], bool]:
        """(reasoning text, deltas, whether the output made tool calls: known when `last`)."""
        thought = ""
        if self.think is not None:
            thought, text = self.think.feed(text)
            if last:
                r2, c2 = self.think.finish()
                thought, text = thought + r2, text + c2
        if self.tools is None:
            return thought, [{"content": text} if text else {}], False
        deltas, has_calls = [self.tools.feed(text)], False
        if last:
            tail, has_calls = self.tools.finish()
            deltas.append(tail)
        return thought, deltas, has_calls


async def chat_completions(st: ServerState, body: ChatCompletionRequest, raw: Request) -> Any:
    run = await submit_chat(st, body, "chatcmpl", thinking_of_effort(body.reasoning_effort))
    if not body.stream:
        accs = await collect(run.choices, raw)
        if accs is None:
            return JSONResponse({}, status_code=499)
        return _whole_chat(st, run, accs)
    stream = _ChatStream(st, run)
    return sse_response(stream_events(run.choices, stream.chunk, stream.final))


def _whole_chat(st: ServerState, run: ChatRun, accs: list[Accumulated]) -> dict[str, Any]:
    """The non-streamed chat.completion: each choice's message, tool calls and reasoning."""
    out = []
    for i, a in enumerate(accs):
        thought, content, calls = whole_output(run, a.text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            **({"tool_calls": calls} if calls else {}),
        }
        finish = a.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        if run.reasoning:
            message["reasoning_content"] = thought or None
        out.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(a.logprobs, st.token_text)
                if run.lp is not None
                else None,
                "finish_reason": finish,
            }
        )
    return {
        **run.envelope(st.settings.served_model_name, "chat.completion"),
        "choices": out,
        "usage": usage(
            len(run.prompt),
            sum(a.num_output_tokens for a in accs),
            max(a.num_cached_tokens for a in accs),
        ),
    }


class _ChatStream:
    """The chat.completion.chunk of each engine output, per choice: the role first, then text,
    reasoning and tool-call deltas; with include_usage a last chunk with the usage."""

    def __init__(self, st: ServerState, call: ChatRun) -> None:
        self.st, self.call = st, call
        k = len(call.choices.rids)
        self.n_out, self.n_cached = [0] * k, [0] * k
        self.extra = {"usage": None} if call.body.include_usage() else {}
        self.splits = [OutputSplit(call) for _ in range(k)]

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
        finish = o.finish_reason
        # The <think> section's text goes to delta.reasoning_content.
        thought, (delta, *tail), has_calls = self.splits[i].feed(o.text, finish is not None)
        for last in tail:
            for k, v in last.items():  # content and tool_calls of the final piece
                delta[k] = delta.get(k, []) + v if k == "tool_calls" else delta.get(k, "") + v
        if has_calls and finish == "stop":
            finish = "tool_calls"
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
