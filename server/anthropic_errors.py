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

from server.errors import ApiError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_status(status: int, code: str | None = None) -> int:
    if status == 503:
        return 429 if code == "queue_full" else 529
    return status


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """`status` is Anthropic's (after anthropic_status)."""
    return {
        "type": "error",
        "error": {
            "type": _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"),
            "message": message,
        },
    }


def anthropic_error(
    status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None
) -> JSONResponse:
    st = anthropic_status(status, code)
    return JSONResponse(anthropic_error_body(st, message), status_code=st, headers=headers)


def anthropic_sse_error(status: int, message: str) -> str:
    return f"event: error\ndata: {json.dumps(anthropic_error_body(anthropic_status(status), message))}\n\n"


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

        return handler
