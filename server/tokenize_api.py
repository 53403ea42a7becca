"""POST /tokenize and /detokenize, in llama-server's form.

/tokenize: {"content": str, "add_special": bool = false, "with_pieces": bool = false} ->
{"tokens": [id, ...]}, or with pieces {"tokens": [{"id": id, "piece": str}, ...]}.
/detokenize: {"tokens": [id, ...]} -> {"content": str}.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from server.errors import ApiError
from server.openapi import error_responses
from server.state import ServerState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # "0" is not false, "1" not a token id
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # "0" is not false, "1" not a token id
    tokens: list[int]


def router(st: ServerState) -> APIRouter:
    r = APIRouter()

    @r.post("/tokenize", responses=error_responses(400, 401, 404, 413, 500, 503))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        st.check_text_length(len(body.content), "content")
        ids: list[int] = await st.off_loop(
            lambda: list(
                st.tokenizer(body.content, add_special_tokens=body.add_special)["input_ids"]
            )
        )
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": st.token_text(t)} for t in ids]}
        return {"tokens": ids}

    @r.post("/detokenize", responses=error_responses(400, 401, 404, 413, 500, 503))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if len(body.tokens) > st.max_model_len * 4:
            raise ApiError(400, f"at most {st.max_model_len * 4} tokens", param="tokens")
        if any(not 0 <= t < st.vocab_size for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {st.vocab_size})", param="tokens")
        return {"content": await st.off_loop(lambda: st.tokenizer.decode(body.tokens))}

    return r
