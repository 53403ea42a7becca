"""The draft-model predictor (engine/prefetch/draft_predictor.py) for a loaded target: the draft
loaded and run as the speculative proposer runs it (engine/speculative/factory.py: the target's
native kernels, its dtype, the lean forward where the draft's architecture has one), with its
vocabulary projection dropped, since the heads read its final hidden state and no token is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from engine.prefetch.draft_predictor import DraftPredictor
from engine.speculative.draft import catch_up_kind
from engine.speculative.factory import check_draft
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_dense_model
from engine.worker.runner import ModelRunner


def draft_predictor(om: Any, draft_dir: str | Path, heads: torch.nn.Module) -> DraftPredictor:
    """A DraftPredictor of `heads` on the draft in `draft_dir`, for the loaded target `om`; give it
    to `om.adapter_prefetcher.use_predictor`."""
    check_draft(om.model_dir, draft_dir)
    draft = load_dense_model(
        draft_dir, device=str(om.device), dtype=om.engine_config.dtype, native=om.native
    )
    draft.model.lm_head = torch.nn.Identity()  # its "logits" are the final norm's output
    runner = ModelRunner(draft)

    def run(window: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
        # The kinds pick the kernels as the proposer's draft steps (one token) and catch-up steps do.
        kind = "decode" if start and len(window) == 1 else catch_up_kind([start])
        return runner.forward([window], [start], [cache], [list(range(len(window)))], kind=kind)[0]

    return DraftPredictor(run, lambda: new_kv_cache(draft.config), heads.to(om.device))
