"""The soak's clients: each `step` sends one request (or one short session) the way a real user
of that API would, through the official SDKs where they exist, and records its Outcome.

SDK retries are off (max_retries=0), so every request the soak counts is one HTTP request; a
client that met a fault backs off as the server's Retry-After asks (at most 1 s) and goes on
with its session, which is what "recovers" means here.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anthropic
import httpx
import openai

from bench.soak_outcomes import Clock, Outcome, complete, from_exception, settle

TIMEOUT_S = 60.0  # a request with no answer by then counts as lost (a hang)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "name": "answer",
    "schema": {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 8}},
        "required": ["word"],
    },
}


@dataclass
class Ctx:
    """What every client shares: the server, the clock, and where outcomes go."""

    base_url: str
    model: str
    clock: Clock
    max_body_bytes: int
    records: list[Outcome] = field(default_factory=list)
    # Set when the soak stops (after the drain): a client's long session ends then.
    stopped: threading.Event = field(default_factory=threading.Event)
    _local: threading.local = field(default_factory=threading.local)

    def openai(self) -> openai.OpenAI:
        """This thread's OpenAI SDK client (one connection pool per client thread)."""
        if not hasattr(self._local, "openai"):
            self._local.openai = openai.OpenAI(
                base_url=self.base_url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S
            )
        return self._local.openai

    def anthropic(self) -> anthropic.Anthropic:
        if not hasattr(self._local, "anthropic"):
            self._local.anthropic = anthropic.Anthropic(
                base_url=self.base_url, api_key="x", max_retries=0, timeout=TIMEOUT_S
            )
        return self._local.anthropic

    def start(self, client: str, kind: str) -> Outcome:
        o = Outcome(client, kind, self.clock.now())
        self.records.append(o)  # list.append is atomic: the clients' threads share the list
        return o


def backoff(o: Outcome) -> None:
    """After a 503/529/429, a fault, or no answer at all, wait before the next request as a
    polite client does (a client that met a dead server must not spin on connection errors)."""
    if o.status in (429, 503, 529) or o.outcome in ("fault", "lost", "refused"):
        time.sleep(0.5)


def _guard(ctx: Ctx, o: Outcome, fn: Callable[[], tuple[bool, str]]) -> Outcome:
    """Run one request; `fn` says whether the answer was whole, unless it settled `o` itself."""
    try:
        ok, why = fn()
        if o.t1 == 0.0:
            complete(o, ctx.clock, ok, why)
    except Exception as e:  # noqa: BLE001 - every failure is classified, none may stop the soak
        from_exception(o, ctx.clock, e)
    backoff(o)
    return o


def openai_chat(ctx: Ctx, rng: random.Random) -> None:
    c = ctx.openai()
    msgs = [{"role": "user", "content": rng.choice(["Hi!", "Name a colour.", "Count to 3."])}]
    kind = rng.choice(["plain", "stream", "tools", "json_schema", "logprobs", "n2", "stream_tools"])
    o = ctx.start("openai_chat", kind)
    args: dict = {"model": ctx.model, "messages": msgs, "max_tokens": rng.randint(4, 16)}
    if kind in ("tools", "stream_tools"):
        args["tools"] = [WEATHER]
    if kind == "json_schema":
        args["response_format"] = {"type": "json_schema", "json_schema": SCHEMA}
        args["max_tokens"] = 32
    if kind == "logprobs":
        args |= {"logprobs": True, "top_logprobs": 2}
    if kind == "n2":
        args["n"] = 2

    def run() -> tuple[bool, str]:
        if kind.startswith("stream"):
            finish = None
            for ch in c.chat.completions.create(**args, stream=True):
                finish = next((x.finish_reason for x in ch.choices if x.finish_reason), finish)
            return finish is not None, "stream ended without a finish_reason"
        r = c.chat.completions.create(**args)
        want = 2 if kind == "n2" else 1
        ok = len(r.choices) == want and all(x.finish_reason for x in r.choices)
        if ok and kind == "json_schema" and r.choices[0].finish_reason == "stop":
            json.loads(r.choices[0].message.content or "")  # the grammar held
        if ok and kind == "logprobs":
            ok = r.choices[0].logprobs is not None
        return ok, f"incomplete body: {r.model_dump_json()[:200]}"

    _guard(ctx, o, run)


def openai_completions(ctx: Ctx, rng: random.Random) -> None:
    c = ctx.openai()
    kind = rng.choice(["plain", "stream", "logprobs", "n2"])
    o = ctx.start("openai_completions", kind)
    args: dict = {
        "model": ctx.model,
        "prompt": "Once upon a time",
        "max_tokens": rng.randint(4, 16),
    }
    args |= {"logprobs": 2} if kind == "logprobs" else {"n": 2} if kind == "n2" else {}

    def run() -> tuple[bool, str]:
        if kind == "stream":
            finish = None
            for ch in c.completions.create(**args, stream=True):
                finish = next((x.finish_reason for x in ch.choices if x.finish_reason), finish)
            return finish is not None, "stream ended without a finish_reason"
        r = c.completions.create(**args)
        return len(r.choices) == args.get("n", 1), f"incomplete body: {r.model_dump_json()[:200]}"

    _guard(ctx, o, run)


def anthropic_messages(ctx: Ctx, rng: random.Random) -> None:
    c = ctx.anthropic()
    kind = rng.choice(["plain", "stream", "tools", "count_tokens"])
    o = ctx.start("anthropic", kind)
    tools = [
        {
            "name": "get_weather",
            "description": "The weather of a city.",
            "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
        }
    ]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    args: dict = {"model": ctx.model, "messages": msgs, "max_tokens": rng.randint(4, 16)}

    def run() -> tuple[bool, str]:
        if kind == "count_tokens":
            n = c.messages.count_tokens(model=ctx.model, messages=msgs, tools=tools)  # type: ignore[arg-type]
            return n.input_tokens > 0, "no input_tokens"
        if kind == "stream":
            kinds = [e.type for e in c.messages.create(**args, stream=True)]
            return kinds[-1:] == ["message_stop"], f"stream ended with {kinds[-1:]}"
        if kind == "tools":
            args["tools"] = tools
        m = c.messages.create(**args)
        return m.stop_reason is not None and bool(m.content), "no stop_reason or content"

    _guard(ctx, o, run)


def responses_chain(ctx: Ctx, rng: random.Random) -> None:
    """A three-turn conversation chained by previous_response_id (the server's response store)."""
    c = ctx.openai()
    prev: str | None = None
    for turn in range(3):
        stream = rng.random() < 0.5
        o = ctx.start("responses", f"turn{turn}{'_stream' if stream else ''}")
        args: dict = {"model": ctx.model, "input": f"Turn {turn}: go on.", "max_output_tokens": 8}
        if prev is not None:
            args["previous_response_id"] = prev
        got: list[str] = []

        def run(args: dict = args, stream: bool = stream, got: list[str] = got) -> tuple[bool, str]:
            if stream:
                last = None
                for ev in c.responses.create(**args, stream=True):
                    last = ev
                ok = last is not None and last.type == "response.completed"
                if ok:
                    got.append(last.response.id)  # type: ignore[union-attr]
                return ok, f"stream ended with {getattr(last, 'type', None)}"
            r = c.responses.create(**args)
            got.append(r.id)
            return r.status in ("completed", "incomplete"), f"status {r.status}"

        _guard(ctx, o, run)
        if o.outcome != "complete":
            return  # the chain starts over, as a client does after a failed turn
        prev = got[0]


def _read_stream(
    ctx: Ctx, o: Outcome, path: str, body: dict, most: int | None, pause: float
) -> tuple[bool, str]:
    """POST a streamed request with httpx and read its `data:` lines (at most `most`, then go
    away; `pause` s after each line).  Settles `o` for an error status or an in-band error."""
    data: list[str] = []
    with (
        httpx.Client(timeout=TIMEOUT_S) as hc,
        hc.stream("POST", ctx.base_url + path, json=body) as r,
    ):
        if r.status_code != 200:
            settle(o, ctx.clock, r.status_code, json.loads(r.read() or b"null"))
            return o.outcome != "lost", o.detail
        for line in r.iter_lines():
            time.sleep(pause)
            if line.startswith("data: "):
                data.append(line[6:])
            if most is not None and len(data) >= most:
                break
    if data[-1:] == ["[DONE]"] and len(data) > 1 and "error" in (last := json.loads(data[-2])):
        settle(o, ctx.clock, None, last)
        return o.outcome != "lost", o.detail
    if most is not None and len(data) >= most:
        o.t1, o.status, o.outcome = ctx.clock.now(), 200, "disconnected"
        return True, ""
    return data[-1:] == ["[DONE]"], f"stream ended with {data[-1:]}"


def disconnect_mid_stream(ctx: Ctx, rng: random.Random) -> None:
    """Opens a long stream, reads a few events, and goes away."""
    o = ctx.start("disconnect", "chat_stream")
    body = {
        "model": ctx.model,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    most = rng.randint(1, 6)
    _guard(ctx, o, lambda: _read_stream(ctx, o, "/v1/chat/completions", body, most, 0.0))


def slow_reader(ctx: Ctx, rng: random.Random) -> None:
    """Reads a stream slowly (0.1 s a line): the server must not block others or give up on it."""
    o = ctx.start("slow_reader", "completions_stream")
    body = {"model": ctx.model, "prompt": "Slowly", "max_tokens": 24, "stream": True}
    _guard(ctx, o, lambda: _read_stream(ctx, o, "/v1/completions", body, None, 0.1))


def oversized(ctx: Ctx, rng: random.Random) -> None:
    """A body over the server's limit, to an OpenAI or an Anthropic route: a 413 in its shape."""
    path = rng.choice(["/v1/chat/completions", "/v1/messages"])
    o = ctx.start("oversized", path.rsplit("/", 1)[-1])
    big = {"model": ctx.model, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    big["pad"] = "x" * (ctx.max_body_bytes + 1024)

    def run() -> tuple[bool, str]:
        r = httpx.post(ctx.base_url + path, json=big, timeout=TIMEOUT_S)
        settle(o, ctx.clock, r.status_code, r.json())
        anthropic_shape = r.json().get("type") == "error"
        if anthropic_shape != (path == "/v1/messages") or r.status_code not in (413, 503):
            o.outcome, o.detail = "lost", f"want a 413 in this API's shape: {r.text[:200]}"
        return True, ""

    _guard(ctx, o, run)
    time.sleep(1.0)  # one every few seconds is plenty


CLIENTS: dict[str, Callable[[Ctx, random.Random], None]] = {
    "openai_chat": openai_chat,
    "openai_completions": openai_completions,
    "anthropic": anthropic_messages,
    "responses": responses_chain,
    "disconnect": disconnect_mid_stream,
    "slow_reader": slow_reader,
    "oversized": oversized,
}
