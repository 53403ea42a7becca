"""Error objects for every failure, and the one place internal errors are logged.

OpenAI shape: {"error": {"message", "type", "param", "code"}}; Anthropic shape (for the
/v1/messages API): {"type": "error", "error": {"type", "message"}}. A response never carries
a traceback, a file path or a module name: an unexpected exception is answered with one line
and an error id, and the traceback goes to the server log at error level under that id
(`internal_error`), so every route, streamed or not, reports failures the same way.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

try:  # newer FastAPI keeps included routers nested in app.routes; this walks the routes inside them
    from fastapi.routing import iter_route_contexts
except ImportError:  # older FastAPI: app.routes is already flat

    def iter_route_contexts(routes: list[BaseRoute]) -> list[BaseRoute]:  # type: ignore[misc]
        return routes


from engine import new_error_id, redact

log = logging.getLogger("moe_offload.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    """Raised by route code; rendered as an OpenAI error object with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = (
            status,
            message,
            param,
            code,
            headers,
        )


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def anthropic_error_body(
    status: int, message: str, type_: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The Anthropic Messages API's error object for `status`; `code` (our fault class, e.g.
    `engine_restarted`) is added when known, as an extra member the SDKs pass through."""
    fallback = "api_error" if status >= 500 else "invalid_request_error"
    err = {"type": type_ or _ANTHROPIC_TYPES.get(status, fallback), "message": message}
    return {"type": "error", "error": err | ({"code": code} if code else {})}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


def client_line(e: BaseException) -> str:
    """One line about a client's mistake that `e` reports, for an error message: a pydantic
    error's first problem as `field: message`, else the first line of its text with paths cut
    to file names (a pydantic or Jinja text runs over many lines and names internals)."""
    if isinstance(e, ValidationError) and e.errors():
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = redact(str(first.get("msg", "")))
        return f"{loc}: {msg}" if loc else msg
    return redact(str(e)) or type(e).__name__


def internal_error(e: BaseException, where: str) -> str:
    """Log `e` with its traceback under a new error id; return the one line a client may see."""
    eid = new_error_id()
    log.error("internal error in %s [error id %s]", where, eid, exc_info=e)
    return f"The server had an error while processing this request (error id {eid})."


def allowed_methods(request: Request) -> str:
    """The `Allow` header of a 405: the methods of every route on this path.  Starlette's own
    names only the first route that matched the path, so a path served by two routes (GET and
    DELETE /v1/responses/{id}) would advertise one of them."""
    methods: set[str] = set()
    for route in iter_route_contexts(request.app.routes):
        if route.methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI clients expect 400 with the offending field in `param`.
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = (
            []
            if first.get("type") == "json_invalid"
            else [str(x) for x in first.get("loc", ()) if x != "body"]
        )
        msg = "; ".join(
            f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg', '')}"
            for err in errs[:5]
        )
        return error_response(400, msg or "invalid request", ".".join(loc) or None, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        headers = dict(e.headers or {})
        if e.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        if request.url.path.startswith("/v1/messages"):  # Anthropic clients read Anthropic's shape
            return JSONResponse(
                anthropic_error_body(e.status_code, str(e.detail)),
                status_code=e.status_code,
                headers=headers,
            )
        return error_response(e.status_code, str(e.detail), None, None, headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(
            500, internal_error(e, f"{request.method} {request.url.path}"), None, "internal_error"
        )
