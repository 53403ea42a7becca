"""The engine core's scheduling limits, and the one place their defaults are written.

`serve`'s flags (server/config.py), the engine process's arguments (engine/launch.py) and the
in-process core (`generate`, the benchmarks) all read these defaults from here. This module
imports nothing heavy, so the command line can read the defaults before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreLimits:
    # Sequences decoded together in one step.
    max_running: int = 64
    # Prompt tokens prefilled per step (longer prompts are prefilled in chunks).
    prefill_token_budget: int = 1024
    # Prompt + output tokens.
    max_model_len: int = 2048
