"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API.

The request becomes a chat request (server/messages_request.py) and runs through the shared
chat path (server/chat_bridge.py); the message and its event stream are
server/messages_stream.py.  count_tokens counts the whole prompt, with a real call's checks.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.anthropic_errors import AnthropicRoute
from server.chat_bridge import finish_chat, start_chat
from server.chat_route import check_messages
from server.messages_request import CountTokensRequest, MessagesRequest, to_chat
from server.messages_stream import stream_events, whole_message
from server.openapi import AnthropicErrorResponse, error_responses, json_or_stream
from server.reasoning import reasoning_prompt
from server.state import ServerState
from server.tools import tool_mode


def router(st: ServerState) -> APIRouter:
    r = APIRouter(route_class=AnthropicRoute)
    model = st.settings.served_model_name

    @r.post(
        "/messages",
        responses={
            **json_or_stream("A message, or its events when streamed."),
            **error_responses(400, 401, 404, 413, 429, 500, 503, 529, model=AnthropicErrorResponse),
        },
    )
    async def create(body: MessagesRequest, raw: Request) -> Any:
        chat = to_chat(body, body.max_tokens, body.stream)
        run = await start_chat(st, chat, "msg", body.thinking_switch())
        mid = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                stream_events(run, mid, model),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        res = await finish_chat(run, raw)
        if res is None:
            return JSONResponse({}, status_code=499)
        return whole_message(res, mid, model)

    @r.post(
        "/messages/count_tokens",
        responses=error_responses(400, 401, 404, 413, 500, 503, model=AnthropicErrorResponse),
    )
    async def count_tokens(body: CountTokensRequest) -> Any:
        chat = to_chat(body)
        st.check_model(chat.model)
        check_messages(st, chat)  # the same limits as a real call
        tool_mode(chat)  # and the same tool checks
        prompt, _, _ = await reasoning_prompt(st, chat, body.thinking_switch())
        return {"input_tokens": len(prompt)}

    return r
