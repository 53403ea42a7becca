"""OpenAI-style error objects: {"error": {"message", "type", "param", "code"}} for every failure."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("moe_offload.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error", 503: "service_unavailable", 500: "internal_server_error"}


class ApiError(Exception):
    """Raised by route code; rendered as an OpenAI error object with this status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI clients expect 400 with the offending field in `param`.
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [] if first.get("type") == "json_invalid" else [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg', '')}" for err in errs[:5])
        return error_response(400, msg or "invalid request", ".".join(loc) or None, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), None, None, dict(e.headers or {}))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}", None, "internal_error")
