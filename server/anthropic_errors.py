"""Anthropic's error shape for /v1/messages: {"type": "error", "error": {"type", "message"}}.

Routes of the Messages API use `AnthropicRoute`, which renders every failure of the route
(validation, an unparsable body, auth, ApiError raised by the shared chat path) in that shape.  Statuses follow
Anthropic's: a full request queue is 429 rate_limit_error (retry later), any other unavailable
engine (our 503: loading, restarting, draining) 529 overloaded_error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import ApiError, anthropic_error_body, internal_error


def anthropic_status(status: int, code: str | None = None) -> int:
    if status == 503:
        return 429 if code == "queue_full" else 529
    return status


def anthropic_error(
    status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None
) -> JSONResponse:
    st = anthropic_status(status, code)
    return JSONResponse(
        anthropic_error_body(st, message, code=code), status_code=st, headers=headers
    )


def anthropic_sse_error(status: int, message: str, code: str | None = None) -> str:
    body = anthropic_error_body(anthropic_status(status, code), message, code=code)
    return f"event: error\ndata: {json.dumps(body)}\n\n"


def validation_message(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', '')}")
    return "; ".join(parts) or "invalid request"


class AnthropicRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except ApiError as e:
                return anthropic_error(e.status, e.message, e.headers, e.code)
            except RequestValidationError as e:
                return anthropic_error(400, validation_message(e))
            except StarletteHTTPException as e:  # e.g. a body that is not UTF-8 JSON
                return anthropic_error(e.status_code, str(e.detail), dict(e.headers or {}))
            except Exception as e:  # noqa: BLE001 - a bug: one line and an error id, in this API's shape
                where = f"{request.method} {request.url.path}"
                return anthropic_error(500, internal_error(e, where), code="internal_error")

        return handler
