"""The OpenAPI document, made to tell the truth: every status a route answers, with the OpenAI
error object as its schema, `text/event-stream` beside JSON where a route streams, and
Prometheus text for /metrics. FastAPI's default 422 is dropped (validation errors are 400s,
as OpenAI answers). Routes added elsewhere (APIRouter modules) reuse `error_responses`.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_WHY = {
    400: "Invalid request: a field out of range, a prompt longer than the context, an unsupported combination.",
    401: "Missing or invalid API key (only when the server was started with API keys).",
    404: "The requested model is not served here.",
    408: "The request timed out.",
    413: "The request body exceeds the server's limit (--max-body-bytes).",
    429: "Too many requests.",
    500: "The engine failed on this request (the message carries an error id; the details are in the server log).",
    503: "Not accepting work now: loading, restarting, shutting down, or the queue is full (see Retry-After).",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str
    code: str | None = None  # an extension: the fault class (engine_restarted, ...) when known


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error object (the /v1/messages API)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class Health(BaseModel):
    status: Literal["ready", "loading", "restarting", "dead", "draining"]
    error: str | None = None  # why the engine is not ready: one line with an error id
    error_id: str | None = None


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status with the error object as its JSON schema."""
    return {s: {"model": model, "description": _WHY.get(s, "Error.")} for s in statuses}


def json_or_stream(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or Server-Sent Events when the request sets `stream: true`."""
    return {
        200: {
            "description": description,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                # Each Server-Sent Event (the schema describes one event, as OpenAPI 3.2's itemSchema does).
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "required": ["data"],
                        "properties": {
                            "data": {
                                "type": "string",
                                "description": "A chunk object as JSON; a failure after the start is an OpenAI error object; the last event is `[DONE]`.",
                            }
                        },
                    }
                },
            },
        }
    }


PROMETHEUS: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format.",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that drops FastAPI's undocumented-in-practice 422s."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=app.description
            )
            for item in doc.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
