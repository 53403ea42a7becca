"""FastAPI app factory: OpenAI routes, /health, /metrics, auth, and the engine's lifespan."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server import chat_route, messages_api, responses_api, routes, tokenize_api
from server.engine_client import EngineState
from server.errors import ApiError, install_error_handlers
from server.limits import BodyLimitMiddleware, RequestCounter
from server.openapi import PROMETHEUS, Health, error_responses, install_openapi, json_or_stream
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.response_store import ResponseStore
from server.state import ServerState, ServeSettings

log = logging.getLogger("moe_offload.server")


def create_app(settings: ServeSettings, tokenizer: Any) -> FastAPI:
    """One app per server; all state hangs off the app (no module-level singletons)."""
    st = ServerState(settings, tokenizer)
    requests = RequestCounter()
    app = FastAPI(title="moe-offload", lifespan=_lifespan(st), docs_url=None, redoc_url=None)
    app.state.server = st
    app.state.requests = requests
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.server.max_body_bytes, counter=requests
    )
    require_api_key = _api_key_check(settings)
    app.include_router(_v1_router(st, require_api_key))
    app.include_router(tokenize_api.router(st), dependencies=[Depends(require_api_key)])
    app.include_router(_operations_router(st))
    return app


def _lifespan(st: ServerState) -> Any:
    """Start the engine with the app, and at its end abort what runs and stop the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        st.client.start()  # spawns the engine; /health says 503 until it reports ready
        try:
            yield
        finally:
            st.client.abort_all()
            await st.client.close()
            st.pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _api_key_check(settings: ServeSettings) -> Callable[[Request], Awaitable[None]]:
    """The dependency that refuses a request without one of --api-key's keys (none: all pass)."""

    async def require_api_key(request: Request) -> None:
        if not settings.server.api_keys:
            return
        auth = request.headers.get("authorization", "")
        key = (
            auth[7:].strip()
            if auth.lower().startswith("bearer ")
            else request.headers.get("x-api-key", "").strip()
        )  # x-api-key: Anthropic clients
        if not any(secrets.compare_digest(key, k) for k in settings.server.api_keys):
            raise ApiError(
                401,
                "Missing or invalid API key (send 'Authorization: Bearer KEY').",
                code="invalid_api_key",
            )

    return require_api_key


def _v1_router(st: ServerState, require_api_key: Any) -> APIRouter:
    """/v1: chat and text completions, models, Responses and Anthropic Messages."""
    settings = st.settings
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    generation_errors = error_responses(400, 401, 404, 413, 500, 503)

    @v1.post(
        "/chat/completions",
        responses={
            **json_or_stream("A chat completion, or its chunks when streamed."),
            **generation_errors,
        },
    )
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        return await chat_route.chat_completions(st, body, raw)

    @v1.post(
        "/completions",
        responses={
            **json_or_stream("A text completion, or its chunks when streamed."),
            **generation_errors,
        },
    )
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await routes.completions(st, body, raw)

    @v1.get("/models", responses=error_responses(401))
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "moe-offload",
                    "max_model_len": settings.engine.limits.max_model_len,
                }
            ],
        }

    v1.include_router(
        responses_api.router(
            st,
            ResponseStore(
                settings.server.responses_store_bytes, settings.server.responses_store_ttl
            ),
        )
    )
    v1.include_router(messages_api.router(st))
    return v1


def _operations_router(st: ServerState) -> APIRouter:
    """/health and /metrics, open without an API key (probes and Prometheus)."""
    ops = APIRouter()

    @ops.get(
        "/health",
        response_model=Health,
        response_model_exclude_none=True,
        responses={
            503: {
                "model": Health,
                "description": "Not ready: loading, restarting, draining or dead (with a short error and its id).",
            }
        },
    )
    async def health() -> JSONResponse:
        status = "draining" if st.draining else st.client.state.value
        body: dict[str, Any] = {"status": status}
        headers = None
        if st.client.state in (EngineState.RESTARTING, EngineState.DEAD):
            body["error"], body["error_id"] = st.client.error, st.client.error_id
        if status in ("loading", "restarting"):
            headers = {"Retry-After": st.client.retry_after()}
        return JSONResponse(body, status_code=200 if status == "ready" else 503, headers=headers)

    @ops.get("/metrics", response_class=Response, responses=PROMETHEUS)
    async def metrics() -> Response:
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return ops


async def drain(st: ServerState, requests: RequestCounter, timeout: float) -> None:
    """SIGTERM: refuse new requests (503), let in-flight ones finish for up to `timeout`, abort
    the rest.  Done means every HTTP response has been written, not just every engine sequence
    ended: the last chunks and [DONE] of a stream are still on their way when its final engine
    output arrives, and closing the listener then cut them off."""
    st.draining = True
    deadline = time.monotonic() + timeout
    log.info(
        "draining %d in-flight sequence(s), %d HTTP request(s) (up to %.0f s)",
        st.client.in_flight,
        requests.active,
        timeout,
    )

    def busy() -> bool:
        return bool(st.client.in_flight or requests.active)

    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if busy():
        log.warning("drain timeout: aborting %d sequence(s)", st.client.in_flight)
        st.client.abort_all()
        end = time.monotonic() + 5.0
        while busy() and time.monotonic() < end:  # let streams send their error + [DONE]
            await asyncio.sleep(0.02)
