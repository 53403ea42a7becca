"""The defects issue 53 found by reading the code as a soak would meet it: every failure of the
Messages and Responses APIs is an error in that API's shape (before or after the 200 header),
paths are cut to file names, client-visible texts are one line, and each error object names
its fault class (`engine_restarted`, `expert_read_failed`, ...)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from jinja2 import TemplateError

from engine.core.faults import fault_class, redact
from server import messages_stream, responses_stream
from server.anthropic_errors import AnthropicRoute
from server.engine_client import EngineClient, EngineFailure, EngineState, _Track
from server.errors import ApiError, install_error_handlers
from server.formatting import failure_of
from server.messages_request import MessagesRequest, to_chat
from server.metrics import ServerMetrics
from server.responses_request import ResponsesRequest
from server.state import ServerState

SECRET = "/srv/secret/engine/worker/runner.py"


def test_unexpected_exception_on_messages_is_anthropic_shaped() -> None:
    app = FastAPI()
    install_error_handlers(app)
    r = APIRouter(route_class=AnthropicRoute)

    @r.post("/v1/messages")
    async def boom() -> None:
        raise KeyError(SECRET)

    app.include_router(r)
    with TestClient(app, raise_server_exceptions=False) as c:
        resp = c.post("/v1/messages", json={})
    body = resp.json()
    assert resp.status_code == 500 and body["type"] == "error", body
    assert body["error"]["type"] == "api_error" and body["error"]["code"] == "internal_error"
    assert "secret" not in resp.text and "KeyError" not in resp.text
    assert re.search(r"error id err-[0-9a-f]+", body["error"]["message"])


class _Run:
    """What the stream writers read of a ChatRun; chat_pieces is replaced by the test."""

    prompt = [1, 2, 3]
    cached = 0

    def __init__(self) -> None:
        self.aborted = False
        self.choices = SimpleNamespace(abort_unfinished=lambda: setattr(self, "aborted", True))


async def _broken_pieces(run: Any) -> AsyncIterator[Any]:
    yield SimpleNamespace(kind="text", text="partial")
    raise AttributeError(f"'NoneType' object has no attribute 'text' in {SECRET}")


async def _collect(gen: AsyncIterator[str]) -> list[str]:
    return [f async for f in gen]


def _frames(events: list[str]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for e in events:
        kind = re.search(r"^event: (\S+)", e, re.M).group(1)  # type: ignore[union-attr]
        out.append((kind, json.loads(re.search(r"^data: (.*)$", e, re.M).group(1))))  # type: ignore[union-attr]
    return out


def test_messages_stream_ends_with_an_error_event_on_an_unexpected_exception(monkeypatch) -> None:
    monkeypatch.setattr(messages_stream, "chat_pieces", _broken_pieces)
    run = _Run()
    frames = _frames(asyncio.run(_collect(messages_stream.stream_events(run, "msg_1", "m"))))  # type: ignore[arg-type]
    kind, data = frames[-1]
    assert kind == "error" and data["type"] == "error", frames
    assert data["error"]["type"] == "api_error" and data["error"]["code"] == "internal_error"
    assert "secret" not in json.dumps(data) and "NoneType" not in json.dumps(data)
    assert frames[0][0] == "message_start" and run.aborted


def test_responses_stream_ends_with_error_and_failed_on_an_unexpected_exception(
    monkeypatch,
) -> None:
    monkeypatch.setattr(responses_stream, "chat_pieces", _broken_pieces)
    resp = responses_stream.ResponseObject(ResponsesRequest(input="hi"), "m")
    run = _Run()
    gen = responses_stream.stream_events(resp, run, {}, lambda *a: {})  # type: ignore[arg-type]
    frames = _frames(asyncio.run(_collect(gen)))
    (k1, err), (k2, failed) = frames[-2:]
    assert k1 == "error" and err["code"] == "internal_error", frames
    assert k2 == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "internal_error"
    assert "secret" not in json.dumps(frames) and run.aborted


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "cannot open models/embedded/target/model.safetensors: gone",
            "cannot open model.safetensors: gone",
        ),
        (f"failed at {SECRET} line 3", "failed at runner.py line 3"),
        ("read ('/mnt/d/a/b.bin') short", "read ('b.bin') short"),
        ("C:\\models\\x\\model.gguf missing", "model.gguf missing"),
        (
            "roles must alternate user/assistant/user/assistant/...",
            "roles must alternate user/assistant/user/assistant/...",
        ),
        ("first line\n  File '/srv/a.py', line 1", "first line"),
    ],
)
def test_redact_keeps_the_file_name_and_no_folder(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_pydantic_error_of_a_converted_request_is_one_line_without_internals() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}],
        }
    )
    with pytest.raises(ApiError) as e:
        to_chat(body, 5, False)
    msg = e.value.message
    assert "\n" not in msg and "ChatCompletionRequest" not in msg and "pydantic" not in msg, msg
    assert "tools.0.function.name" in msg and e.value.status == 400


class _Tokenizer:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def apply_chat_template(self, *a: Any, **k: Any) -> str:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "want"),
    [
        (
            TemplateError("Conversation roles must alternate\nuser/assistant/user/assistant"),
            "roles must alternate",
        ),
        (TypeError(f"can only concatenate str (not 'list') in {SECRET}\n  File x"), "(TypeError)"),
    ],
)
def test_template_errors_are_one_line_without_internals(exc: Exception, want: str) -> None:
    fake = SimpleNamespace(tokenizer=_Tokenizer(exc))
    with pytest.raises(ApiError) as e:
        ServerState.chat_prompt(fake, [{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    msg = e.value.message
    assert e.value.status == 400 and "\n" not in msg and "secret" not in msg and want in msg, msg


def test_request_faults_name_their_class() -> None:
    expert = "expert load failed for this request: expert 3 of layer 1 could not be loaded (OSError: Input/output error) (error id err-1)"
    assert failure_of("error", expert) == (
        500,
        f"The engine failed on this request: {expert}",
        "expert_read_failed",
    )
    assert fault_class("sampling failed for this request: x") == "sampling_failed"
    assert fault_class("something else") == "engine_error"


class _Loop:
    def call_later(self, delay: float, fn: Any) -> None:
        self.delay = delay


@pytest.mark.parametrize(("max_restarts", "code"), [(3, "engine_restarted"), (0, "engine_dead")])
def test_engine_death_names_restarted_or_dead(max_restarts: int, code: str) -> None:
    client = EngineClient(None, ServerMetrics(), max_restarts=max_restarts)  # type: ignore[arg-type]
    client._loop = _Loop()  # type: ignore[assignment]
    client._engine = SimpleNamespace(release=lambda: None)  # type: ignore[assignment]
    client.state, client.engine_pid = EngineState.READY, 1234
    track = _Track(asyncio.Queue())
    client._reqs["r1"] = track
    client._on_death("engine process exited (code -9)")
    failure = track.queue.get_nowait()
    assert isinstance(failure, EngineFailure) and failure.code == code
    expected = EngineState.RESTARTING if max_restarts else EngineState.DEAD
    assert client.state is expected
