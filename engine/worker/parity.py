"""Full-prompt logits through the runner: what the parity checks (tests, bench/gpu_check.py) compare."""

from __future__ import annotations

import torch

from engine.worker.kv_cache import new_kv_cache
from engine.worker.loaded_model import LoadedModel
from engine.worker.runner import ModelRunner


def prompt_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Full-prompt logits [S, V] from one forward through the runner (parity checks)."""
    runner = ModelRunner(lm)
    return runner.forward([list(ids)], [0], [new_kv_cache(lm.config)], [list(range(len(ids)))])[0]
