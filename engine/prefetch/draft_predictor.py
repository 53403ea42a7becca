"""The draft-model predictor in the engine (seed 003's draft baseline, engine/prefetch/predictors.py):
the speculative pair's draft runs on the target's step tokens, and one head per target MoE layer maps
the draft's last hidden state to that layer's expert scores.

Call form: the adapter's, `module(x [T, D], anchor, base) -> logits [T, E]`, so AdapterPrefetcher
(engine/prefetch/adapter_prefetcher.py) drives it like any other predictor. It ignores x, the
target's router input: it answers from the draft's hidden states of the same rows, which
`begin_step` computes once per forward from the step's tokens (the routing bus's StepContext).
AdapterPrefetcher calls `begin_step` at the first routing event of each forward, on the compute
thread, so the draft's forward is charged to the decode, as it would be on a CPU.
engine/speculative/draft_prefetch.py builds one that runs the draft as the speculative proposer does.

- Each request keeps its own draft KV cache, cropped back to its window's first position before the
  window is fed: rejected proposals and rolled-back steps leave it, as in engine/speculative/draft.py.
- Where the draft has not seen a request's tokens before its window (a prefix-cache hit skipped them,
  or the cache was dropped), the window runs on its own from an empty cache: a worse prediction.
- Predictions only start transfers: the target's own routers still pick the experts that run.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from engine.experts.routing_bus import StepContext

MAX_REQUESTS = 64  # draft KV caches kept, the least recently used dropped first

# run(window, start, cache) -> [len(window), D_draft]: the draft's final hidden state of each token
# of `window`, whose first token sits at position `start`; `cache` holds the tokens before it and
# takes the window's.
DraftRun = Callable[[list[int], int, DynamicCache], torch.Tensor]


class DraftPredictor(nn.Module):
    def __init__(
        self, run: DraftRun, new_cache: Callable[[], DynamicCache], heads: nn.Module
    ) -> None:
        """heads: `heads(h [T, D_draft], anchor, None) -> [T, E]`, one per anchor (the target's MoE
        layers but the last: predictors.py PerLayerPredictor with fate_base=False)."""
        super().__init__()
        self.run, self.new_cache, self.heads = run, new_cache, heads.eval()
        self.fate_base = False  # AdapterPrefetcher passes no router guess
        self._caches: OrderedDict[str, DynamicCache] = OrderedDict()
        self._hidden: torch.Tensor | None = None  # [T, D_draft] of the current forward's rows
        self.seconds = 0.0  # the draft's own time, for reports
        self.rows = 0  # tokens it ran
        self.calls = 0  # forwards it ran (one per target forward it covered)

    @torch.inference_mode()
    def begin_step(self, step: StepContext, rows: int) -> bool:
        """Run the draft on every window of the forward that `step` describes. Returns whether it
        covers the forward's `rows` (False where the step carries no tokens: nothing to predict)."""
        self._hidden = None
        if sum(len(w) for w in step.windows) != rows or not rows:
            return False
        t0 = time.perf_counter()
        out = []
        for i, (window, start) in enumerate(zip(step.windows, step.starts)):
            rid = step.request_ids[i] if i < len(step.request_ids) else f"#{i}"
            cache = self._cache(rid, start)
            out.append(self.run(window, cache.get_seq_length(), cache).float())
        self._hidden = torch.cat(out)
        self.seconds += time.perf_counter() - t0
        self.rows += rows
        self.calls += 1
        return True

    def _cache(self, rid: str, start: int) -> DynamicCache:
        """The request's draft cache holding exactly its tokens before `start` (an empty one where
        it does not hold them all)."""
        cache = self._caches.pop(rid, None)
        if cache is None or cache.get_seq_length() < start:
            cache = self.new_cache()
        elif cache.get_seq_length() > start:
            cache.crop(start - cache.get_seq_length())  # a negative count: the tokens to remove
        self._caches[rid] = cache  # most recently used last
        while len(self._caches) > MAX_REQUESTS:
            self._caches.popitem(last=False)
        return cache

    def forward(
        self, x: torch.Tensor, anchor: int | torch.Tensor, base: torch.Tensor | None
    ) -> torch.Tensor:
        """The next layer's expert scores [T, E] for the rows begin_step ran (x: only its row count)."""
        h = self._hidden
        assert h is not None and h.shape[0] == x.shape[0], "begin_step must cover these rows"
        return self.heads(h.to(x.device), anchor, None)
