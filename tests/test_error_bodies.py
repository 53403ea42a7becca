"""No internals in responses (issue 30): an unexpected exception, in a route or in the middle of
a stream, answers one line with an error id; the traceback is logged at error level under it."""

from __future__ import annotations

import asyncio
import json
import logging
import re

from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.errors import anthropic_error_body, install_error_handlers
from server.routes import stream_events


def _logged(caplog, eid: str) -> logging.LogRecord:
    return next(
        r
        for r in caplog.records
        if eid in r.getMessage() and r.levelno == logging.ERROR and r.exc_info
    )


def test_unexpected_exception_is_an_error_id_not_a_traceback(caplog) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise KeyError("/srv/secret/engine/worker/runner.py")

    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    msg = r.json()["error"]["message"]
    assert "secret" not in msg and "KeyError" not in msg and "Traceback" not in r.text
    eid = re.search(r"error id (err-[0-9a-f]+)", msg).group(1)
    assert "secret" in str(_logged(caplog, eid).exc_info[1])


class _Choices:
    """One choice whose outputs never arrive: make_chunk fails on the opening chunk."""

    rids = ("a",)
    done = False

    def abort_unfinished(self) -> None:
        self.aborted = True


def test_streamed_internal_error_is_in_band_and_the_stream_ends(caplog) -> None:
    def make_chunk(i, o):
        raise AttributeError("'NoneType' object has no attribute 'text' in server/formatting.py")

    async def run() -> list[str]:
        return [e async for e in stream_events(_Choices(), make_chunk, lambda: None)]  # type: ignore[arg-type]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    err = json.loads(events[-2][6:])["error"]
    assert (
        err["code"] == "internal_error"
        and "formatting" not in err["message"]
        and "NoneType" not in err["message"]
    )
    _logged(caplog, re.search(r"error id (err-[0-9a-f]+)", err["message"]).group(1))


def test_anthropic_error_shape() -> None:
    assert anthropic_error_body(400, "bad") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
    assert anthropic_error_body(413, "big")["error"]["type"] == "request_too_large"
    assert anthropic_error_body(529, "busy")["error"]["type"] == "overloaded_error"
    assert anthropic_error_body(500, "x")["error"]["type"] == "api_error"


def _two_route_app() -> FastAPI:
    """One path served by two routes (GET and DELETE), as /v1/responses/{id} is, and a Messages route."""
    from fastapi import APIRouter

    from server.anthropic_errors import AnthropicRoute

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/items/{item_id}")
    async def get(item_id: str) -> dict:
        return {"id": item_id}

    @app.delete("/items/{item_id}")
    async def delete(item_id: str) -> dict:
        return {"id": item_id}

    r = APIRouter(route_class=AnthropicRoute)

    @r.post("/v1/messages")
    async def messages(body: dict) -> dict:
        return body

    app.include_router(r)
    return app


def test_405_allow_lists_every_route_of_the_path() -> None:
    with TestClient(_two_route_app()) as c:
        for method in ("OPTIONS", "POST", "PUT", "HEAD"):
            r = c.request(method, "/items/0")
            assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", (method, r.headers)
            if method != "HEAD":
                assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.get("/v1/messages")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["type"] == "error"


def test_messages_body_that_is_not_utf8_is_an_anthropic_error() -> None:
    with TestClient(_two_route_app()) as c:
        r = c.post(
            "/v1/messages", content=b"\x1c\xff", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "There was an error parsing the body",
        },
    }
