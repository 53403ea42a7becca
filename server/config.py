"""Server settings: a frozen dataclass, read from the `server:` section of configs/*.yaml."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError
from engine.settings_file import YamlSection


@dataclass(frozen=True)
class ServerConfig(YamlSection):
    SECTION = "server"

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None  # default: the model directory's name
    max_running: int = 64  # sequences decoded together in one engine step
    max_queue: int = 256  # further sequences allowed to wait; beyond this: 503 + Retry-After
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    prefill_token_budget: int = 1024  # prompt tokens prefilled per engine step (decodes keep flowing)
    drain_timeout: float = 30.0  # SIGTERM: seconds in-flight requests may take before being aborted
    log_level: str = "info"
    # Abuse limits and engine supervision (issue 14):
    max_body_bytes: int = 8 * 1024 * 1024  # request bodies over this get 413 before they are read (--max-body-bytes)
    max_messages: int = 1024  # chat messages per request
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_request_tokens: int = 262144  # n x max_tokens summed over a request's prompts
    engine_restarts: int = 3  # engine restarts within engine_restart_window before the server exits 1 (--engine-restarts)
    engine_restart_window: float = 600.0  # seconds

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_running < 1 or self.max_queue < 0:
            raise ConfigError("max_running must be >= 1 and max_queue >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefill_token_budget < 1 or self.drain_timeout < 0:
            raise ConfigError("prefill_token_budget must be >= 1 and drain_timeout >= 0")
        if self.max_body_bytes < 1024 or min(self.max_messages, self.max_prompts, self.max_request_tokens) < 1:
            raise ConfigError("max_body_bytes must be >= 1024; max_messages, max_prompts and max_request_tokens >= 1")
        if self.engine_restarts < 0 or self.engine_restart_window <= 0:
            raise ConfigError("engine_restarts must be >= 0 and engine_restart_window > 0")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
