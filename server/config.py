"""Server settings: a frozen dataclass, read from the `server:` section of configs/*.yaml."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine import ConfigError, CoreLimits, YamlSection, setting


@dataclass(frozen=True)
class ServerConfig(YamlSection):
    SECTION = "server"

    host: str = setting(
        "127.0.0.1",
        "address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)",
        metavar="ADDR",
    )
    port: int = setting(8000, "TCP port (default 8000)", metavar="N")
    api_keys: tuple[str, ...] = setting(
        (),
        "require 'Authorization: Bearer KEY' on /v1/* (repeatable: any listed key is accepted); /health and /metrics stay public",
        metavar="KEY",
        flag="--api-key",
        repeat=True,
    )
    served_model_name: str | None = setting(
        None,
        "model id clients must send and /v1/models lists (default: the model directory's name)",
        metavar="NAME",
    )
    max_running: int = setting(
        CoreLimits.max_running,
        f"sequences decoded together in one engine step (default {CoreLimits.max_running})",
        metavar="N",
    )
    max_queue: int = setting(
        256,
        "sequences allowed to wait beyond --max-running; more get 503 with Retry-After (default 256)",
        metavar="N",
    )
    max_model_len: int | None = setting(
        None,
        "context length: prompt + max_tokens must fit (default: the model's max_position_embeddings)",
        metavar="N",
    )
    prefill_token_budget: int = setting(
        CoreLimits.prefill_token_budget,
        f"prompt tokens prefilled per engine step; longer prompts are prefilled in chunks while decodes keep flowing (default {CoreLimits.prefill_token_budget})",
        metavar="N",
    )
    drain_timeout: float = setting(
        30.0,
        "on SIGTERM/SIGINT: seconds in-flight requests may take to finish before they are aborted (default 30)",
        metavar="S",
    )
    log_level: str = setting(
        "info", "log verbosity (default info)", choices=("debug", "info", "warning", "error")
    )
    # Abuse limits and engine supervision:
    max_body_bytes: int = setting(
        8 * 1024 * 1024,
        "request bodies over this many bytes get 413 before they are read (default 8 MiB)",
        metavar="N",
    )
    max_messages: int = setting(1024, "chat messages per request (default 1024)", metavar="N")
    max_prompts: int = setting(64, "prompts in one /v1/completions batch (default 64)", metavar="N")
    max_request_tokens: int = setting(
        262144, "n x max_tokens summed over a request's prompts (default 262144)", metavar="N"
    )
    engine_restarts: int = setting(
        3,
        "engine restarts allowed within --engine-restart-window before the server exits 1 so its supervisor restarts it (default 3)",
        metavar="N",
    )
    engine_restart_window: float = setting(
        600.0, "seconds over which engine restarts are counted (default 600)", metavar="S"
    )
    engine_preload: bool = setting(
        True,
        "start each engine as a plain spawned process that imports torch, transformers and the engine itself, instead of forking it from a forkserver that imported them once (the default: a restart after an engine crash then skips those imports, most of its time on a small CPU; server/engine_spawn.py)",
        flag="--no-engine-preload",
    )
    # /v1/responses with store=true (the default): GET /v1/responses/{id} and previous_response_id read them.
    responses_store_bytes: int = setting(
        64 * 1024 * 1024,
        "bytes of stored /v1/responses (response and conversation as JSON) kept for GET and previous_response_id; the oldest are evicted first (default 64 MiB)",
        metavar="N",
    )
    responses_store_ttl: float = setting(
        3600.0, "seconds a stored /v1/responses response is kept (default 3600)", metavar="S"
    )
    default_max_tokens: int | None = setting(
        None,
        "output tokens of a request that sets no limit (chat max_tokens, Responses max_output_tokens; Codex sends none) (default: the rest of the context)",
        metavar="N",
    )
    # For trying agent clients end to end with a model that would not call a tool by itself.
    force_tool_call: tuple[str, ...] = setting(
        (),
        "testing agents: a request that offers the tool NAME and holds no tool result yet gets one grammar-forced call of it; =JSON pins its arguments (repeatable: the first one a request offers; default: off)",
        metavar="NAME[=JSON]",
        repeat=True,
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_running < 1 or self.max_queue < 0:
            raise ConfigError("max_running must be >= 1 and max_queue >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefill_token_budget < 1 or self.drain_timeout < 0:
            raise ConfigError("prefill_token_budget must be >= 1 and drain_timeout >= 0")
        if (
            self.max_body_bytes < 1024
            or min(self.max_messages, self.max_prompts, self.max_request_tokens) < 1
        ):
            raise ConfigError(
                "max_body_bytes must be >= 1024; max_messages, max_prompts and max_request_tokens >= 1"
            )
        if self.engine_restarts < 0 or self.engine_restart_window <= 0:
            raise ConfigError("engine_restarts must be >= 0 and engine_restart_window > 0")
        if self.responses_store_bytes < 0 or self.responses_store_ttl <= 0:
            raise ConfigError("responses_store_bytes must be >= 0 and responses_store_ttl > 0")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "force_tool_call", tuple(self.force_tool_call))
        self.forced()  # a ConfigError names a bad one now

    def core_limits(self, max_model_len: int) -> CoreLimits:
        """The engine core's limits: every CoreLimits field this config has (max_running,
        prefill_token_budget), taken by name, and the context length resolved against the model."""
        shared = {
            f.name: getattr(self, f.name) for f in fields(CoreLimits) if hasattr(self, f.name)
        }
        return CoreLimits(**{**shared, "max_model_len": max_model_len})

    def forced(self) -> tuple[tuple[str, dict[str, Any] | None], ...]:
        """--force-tool-call as (tool name, pinned arguments or None) pairs."""
        return tuple(forced_tool(s) for s in self.force_tool_call)


def forced_tool(spec: str) -> tuple[str, dict[str, Any] | None]:
    name, eq, args = spec.partition("=")
    if not name:
        raise ConfigError("force_tool_call needs a tool name: NAME or NAME=JSON")
    if not eq:
        return name, None
    try:
        pinned = json.loads(args)
    except json.JSONDecodeError as e:
        raise ConfigError(f"force_tool_call: the arguments after = are not JSON ({e})") from None
    if not isinstance(pinned, dict):
        raise ConfigError("force_tool_call: the arguments after = must be a JSON object")
    return name, pinned
