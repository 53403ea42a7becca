"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API.

The request becomes a chat request (server/responses_request.py) and runs through the shared
chat path (server/chat_bridge.py); its output and event stream are server/responses_stream.py.
With `previous_response_id`, the stored conversation of that response comes first (its
instructions are not carried over, as OpenAI specifies); `store` keeps the response and its
conversation in the bounded store (server/response_store.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.chat_bridge import ChatResult, finish_chat, start_chat
from server.errors import ApiError
from server.openapi import error_responses, json_or_stream
from server.protocol import ChatMessage
from server.reasoning import thinking_of_effort
from server.response_store import ResponseStore
from server.responses_request import ResponsesRequest, assistant_turn, to_chat
from server.responses_stream import ResponseObject, status_of, stream_events, whole_output
from server.state import ServerState


def router(st: ServerState, store: ResponseStore) -> APIRouter:
    r = APIRouter()

    @r.post(
        "/responses",
        responses={
            **json_or_stream("A response, or its typed events when streamed."),
            **error_responses(400, 401, 404, 413, 429, 500, 503),
        },
    )
    async def create(body: ResponsesRequest, raw: Request) -> Any:
        history: list[ChatMessage] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id)
            if prev is None:
                raise ApiError(
                    404,
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                )
            history = [ChatMessage.model_validate(m) for m in prev.conversation]
        chat, conv, spaced = to_chat(body, history)
        effort = body.reasoning.effort if body.reasoning else None
        run = await start_chat(st, chat, "resp", thinking_of_effort(effort))
        resp = ResponseObject(body, st.settings.served_model_name)

        def finish(
            status: str,
            output: list[dict[str, Any]],
            result: ChatResult,
            text: str,
            calls: list[dict[str, Any]],
        ) -> dict[str, Any]:
            turn = [m.model_dump(exclude_none=True) for m in conv + [assistant_turn(text, calls)]]
            stored = body.store and store.put(resp.id, resp.obj(status, output, result, True), turn)
            return resp.obj(status, output, result, stored)

        if body.stream:
            return StreamingResponse(
                stream_events(resp, run, spaced, finish),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = await finish_chat(run, raw)
        if result is None:
            return JSONResponse({}, status_code=499)
        output = whole_output(result, spaced)
        return finish(status_of(result), output, result, result.text or "", result.calls)

    @r.get("/responses/{response_id}", responses=error_responses(401, 404))
    async def retrieve(response_id: str) -> Any:
        item = store.get(response_id)
        if item is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
        return item.response

    @r.delete("/responses/{response_id}", responses=error_responses(401, 404))
    async def delete(response_id: str) -> Any:
        if not store.delete(response_id):
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return r
