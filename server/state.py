"""Front-end state shared by the routes: tokenizer, engine client, metrics, admission checks."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from engine import ConstraintSpec, EngineArgs, GenerateRequest, RequestOutput, SamplingParams
from server.config import ServerConfig
from server.engine_client import EngineClient, EngineFailure, EngineState
from server.errors import ApiError, client_line
from server.metrics import ServerMetrics
from server.protocol import _SamplingFields

# Below this, temperature means greedy (as vLLM does): logits / 1e-300 overflow to inf and the
# softmax turns to NaN (found by tests/test_fuzz.py).
TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class ServeSettings:
    """What the routes read: the engine process's arguments, the model name clients send, and the
    `server:` settings as given. Each setting and its default is defined once, in ServerConfig
    (server/config.py); nothing is copied here."""

    engine: EngineArgs
    served_model_name: str  # ServerConfig's, or the model directory's name where it names none
    server: ServerConfig = field(default_factory=ServerConfig)

    @cached_property
    def forced_tools(self) -> tuple[tuple[str, dict[str, Any] | None], ...]:
        """--force-tool-call parsed once: (tool name, pinned arguments or None) pairs."""
        return self.server.forced()


class ServerState:
    def __init__(self, settings: ServeSettings, tokenizer: Any) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics()
        self.client = EngineClient(
            settings.engine,
            self.metrics,
            settings.server.engine_restarts,
            settings.server.engine_restart_window,
            preload=settings.server.engine_preload,
        )
        self.draining = False
        cfg = json.loads((Path(settings.engine.model_dir) / "config.json").read_text())
        self.vocab_size = int(cfg.get("text_config", cfg).get("vocab_size") or len(tokenizer))
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        # Tokenization and chat templating run here, never on the event loop: a long prompt
        # must not stall /health or other clients.  Two workers: the fast tokenizer releases
        # the GIL, and more threads would only queue behind the 2 cores.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        # The longest vocabulary entry bounds characters per token from above, so a text with
        # more than max_model_len * that many characters cannot fit: refused without tokenizing.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_text_length(self, n_chars: int, param: str) -> None:
        """Cheap bound before tokenizing: each token covers at most `max_token_chars` characters."""
        if n_chars > self.max_model_len * self.max_token_chars:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, and the input ({n_chars} characters) is certainly longer.",
                param=param,
                code="context_length_exceeded",
            )

    @property
    def max_model_len(self) -> int:
        return self.settings.engine.limits.max_model_len

    # -- admission -------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.served_model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.settings.served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_accepting(self, n_seqs: int) -> None:
        retry = {"Retry-After": "1"}
        if self.draining:
            raise ApiError(503, "The server is shutting down.", code="shutting_down", headers=retry)
        if self.client.state is EngineState.LOADING:
            raise ApiError(
                503,
                "The model is still loading.",
                code="loading",
                headers={"Retry-After": self.client.retry_after()},
            )
        if self.client.state is EngineState.RESTARTING:
            raise ApiError(
                503,
                f"The engine is restarting after a failure ({self.client.error}).",
                code="engine_restarting",
                headers={"Retry-After": self.client.retry_after()},
            )
        if self.client.state is EngineState.DEAD:  # restart budget spent: the server is exiting
            raise ApiError(
                503, f"The engine is not running: {self.client.error}", code="engine_dead"
            )
        cap = self.settings.engine.limits.max_running + self.settings.server.max_queue
        if n_seqs > cap:  # could never be admitted: retrying would not help, so not a 503
            raise ApiError(
                400,
                f"This request needs {n_seqs} sequences (prompts x n); this server holds at most {cap} at once.",
                param="n",
            )
        if self.client.in_flight + n_seqs > cap:
            raise ApiError(
                503,
                f"The request queue is full ({cap} sequences); retry later.",
                code="queue_full",
                headers=retry,
            )

    # -- prompts ---------------------------------------------------------------------
    def chat_prompt(
        self,
        msgs: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_vars: dict[str, Any] | None = None,
    ) -> list[int]:
        """Runs in the tokenizer pool (blocking).  `template_vars`: e.g. enable_thinking."""
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                **(template_vars or {}),
            )
        except (TemplateError, ValueError) as e:  # the template's own checks (e.g. role order)
            msg = f"cannot apply the chat template: {client_line(e)}"
            raise ApiError(400, msg, param="messages") from None
        except Exception as e:  # noqa: BLE001 - e.g. a field of a type the template cannot use
            msg = f"cannot apply the chat template to these messages ({type(e).__name__})"
            raise ApiError(400, msg, param="messages") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text_prompts(self, prompt: Any) -> list[list[int]]:
        """Completions prompt: str, [str], [int] or [[int]] -> token id lists (blocking; tokenizer pool)."""
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(prompts) > self.settings.server.max_prompts:
            raise ApiError(
                400,
                f"at most {self.settings.server.max_prompts} prompts per request",
                param="prompt",
            )
        for p in prompts:
            if isinstance(p, str):
                self.check_text_length(len(p), "prompt")
            elif len(p) > self.max_model_len:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens; a prompt has {len(p)}.",
                    param="prompt",
                    code="context_length_exceeded",
                )
        out = []
        for p in prompts:
            ids = list(self.tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p)
            if not ids:
                raise ApiError(400, "prompt must contain at least one token", param="prompt")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ApiError(
                    400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
                )
            out.append(ids)
        return out

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- engine requests ---------------------------------------------------------------
    def make_requests(
        self,
        rid: str,
        prompts: list[list[int]],
        body: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        constraint: ConstraintSpec | None = None,
    ) -> list[GenerateRequest]:
        if (
            max_tokens is not None
            and max_tokens * body.n * len(prompts) > self.settings.server.max_request_tokens
        ):
            raise ApiError(
                400,
                f"n x max_tokens over all prompts ({max_tokens * body.n * len(prompts)}) exceeds this server's limit of {self.settings.server.max_request_tokens} tokens per request",
                param="max_tokens",
            )
        reqs = []
        for pi, ids in enumerate(prompts):
            if max_tokens is None and len(ids) >= self.max_model_len:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has {len(ids)} tokens, leaving no room for a completion.",
                    param="messages",
                    code="context_length_exceeded",
                )
            room = self.max_model_len - len(ids)
            default = self.settings.server.default_max_tokens
            limit = max_tokens if max_tokens is not None else min(room, default or room)
            # max_tokens 0 (echo, prompt logprobs only) still runs one engine step, whose token is dropped.
            engine_limit = max(limit, 1)
            if len(ids) + limit > self.max_model_len:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested {len(ids) + limit} tokens ({len(ids)} in the prompt, {limit} in the completion).",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            if body.min_tokens > limit:
                raise ApiError(
                    400,
                    f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({limit})",
                    param="min_tokens",
                )
            for i in range(body.n):
                try:
                    params = SamplingParams(
                        max_tokens=engine_limit,
                        temperature=body.temperature
                        if body.temperature >= TEMPERATURE_EPS
                        else 0.0,
                        top_p=body.top_p,
                        top_k=max(body.top_k, 0),
                        # n > 1 with a seed: distinct but reproducible choices.
                        seed=None
                        if body.seed is None
                        else (body.seed + pi * body.n + i) % 2**63,  # any int is valid
                        stop=body.stop_list(),
                        ignore_eos=body.ignore_eos,
                        min_tokens=body.min_tokens,
                    )
                except ValueError as e:
                    raise ApiError(400, client_line(e)) from None
                reqs.append(
                    GenerateRequest(
                        f"{rid}-{pi * body.n + i}",
                        ids,
                        params,
                        logprobs,
                        prompt_logprobs,
                        body.presence_penalty,
                        body.frequency_penalty,
                        constraint,
                    )
                )
        return reqs

    def submit(self, reqs: list[GenerateRequest]) -> Choices:
        self.check_accepting(len(reqs))
        return Choices(self.client, [r.request_id for r in reqs], self.client.submit(reqs))


class Choices:
    """The outputs of one HTTP request's sequences (choices), in arrival order."""

    def __init__(
        self, client: EngineClient, rids: list[str], q: asyncio.Queue[RequestOutput | EngineFailure]
    ) -> None:
        self.client, self.rids, self.q = client, rids, q
        self.index = {r: i for i, r in enumerate(rids)}
        self.unfinished = set(rids)

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def next(self, timeout: float | None = None) -> tuple[int, RequestOutput] | None:
        """The next output and its choice index; None on timeout; raises EngineFailure."""
        try:
            item = await asyncio.wait_for(self.q.get(), timeout) if timeout else await self.q.get()
        except asyncio.TimeoutError:
            return None
        if isinstance(item, EngineFailure):
            self.unfinished.clear()
            raise item
        if item.finish_reason is not None:
            self.unfinished.discard(item.request_id)
        return self.index[item.request_id], item

    def abort_unfinished(self) -> None:
        """Client gone or request failed: free the engine's KV caches and slots now."""
        for rid in self.unfinished:
            self.client.abort(rid)
