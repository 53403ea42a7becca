"""What a request asks of sampling (plain data, picklable): part of a GenerateRequest, read by the
scheduler (max_tokens, stops) and by the runner's sampler (engine/worker/sampling.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.settings_file import setting


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = setting(64, "maximum new tokens (default 64)", metavar="N")
    temperature: float = setting(0.0, "sampling temperature; 0 = greedy (default 0)", metavar="T")
    top_p: float = setting(1.0, "nucleus sampling mass (default 1.0 = off)", metavar="P")
    top_k: int = setting(0, "sample among the K most likely tokens (default 0 = off)", metavar="K")
    seed: int | None = setting(None, "random seed for sampling (reproducible output)", metavar="S")
    stop: tuple[str, ...] = setting(
        (),
        "stop when this text appears (repeatable); it is not included in the output",
        metavar="TEXT",
        repeat=True,
    )
    ignore_eos: bool = setting(False, "keep generating past the end-of-sequence token")
    min_tokens: int = setting(
        0, "do not end (EOS) before this many tokens (default 0)", metavar="N"
    )

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
