"""Draft-model proposals: a small dense model, fully resident, batched across requests.

Each request keeps its own draft KV cache. Before proposing, the draft catches up with the
request's confirmed tokens: whatever of its cache disagrees with them (rejected proposals of
the last window) is cropped, and the missing tokens are fed as one window. Then it proposes
k tokens one at a time; every one of these draft steps is a single packed forward over all
speculating requests, exactly like the target's step.

Proposals are processed like the target's own choice (penalties with the tokens proposed so
far, the min_tokens EOS ban, temperature, top-k, top-p). Greedy requests take the draft's
argmax; sampled requests draw from the draft's distribution q, which goes into the window so
that verification can use the exact rejection rule.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.core.step_types import SeqWork, StepPlan
from engine.speculative.proposals import ProposerBase, history, with_drafts
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loaded_model import LoadedModel
from engine.worker.runner import ModelRunner, truncate_cache
from engine.worker.sampling import (
    draw,
    make_generator,
    process_logits,
    seeded_draw,
    target_probs,
)


class DraftProposer(ProposerBase):
    def __init__(self, draft: LoadedModel, k, stats) -> None:
        super().__init__(k, stats)
        self.draft = draft
        # The target's runner and KV cache: its lean forward where the draft's architecture allows it
        # (engine/worker/lean_forward.py), since a draft step must cost little next to a target step
        # and transformers' module calls are most of a small draft's time; transformers' otherwise.
        self.runner = ModelRunner(draft)
        self.eos_ids = sorted(draft.eos_token_ids)
        self.caches: dict[str, DynamicCache] = {}  # in place (engine/worker/kv_cache.py)
        self.fed: dict[str, list[int]] = {}  # tokens in the draft's KV cache, per request
        self.generators: dict[str, torch.Generator | None] = {}

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        for d in (self.caches, self.fed, self.generators):
            d.pop(request_id, None)

    @torch.inference_mode()
    def _propose(self, plan: StepPlan) -> StepPlan:
        for rid in plan.free_ids:
            self.forget(rid)
        active = [(i, w, k) for i, w in enumerate(plan.work) if (k := self.budget(w)) > 0]
        if not active:
            return plan
        windows, starts, caches = [], [], []
        for _, w, _ in active:
            rid, full = w.request_id, history(w)
            if rid not in self.caches:
                self.caches[rid] = new_kv_cache(self.draft.config)
                self.fed[rid] = []
                self.generators[rid] = _draft_generator(w, self.draft.device)
            # Only the last window's proposals can disagree with the confirmed tokens: compare the tail.
            keep = _common_prefix(
                self.fed[rid], full, max(0, len(self.fed[rid]) - self.k.k_max - 1)
            )
            truncate_cache(self.caches[rid], keep)  # drop the rejected tail of the last window
            windows.append(full[keep:])
            starts.append(keep)
            caches.append(self.caches[rid])
            self.fed[rid] = full
        # A window of confirmed tokens is at most k_max + 1 long; a longer catch-up (a prompt, a stretch
        # without proposals) would charge its prefill to the proposals' cost (adaptive k's estimate).
        self._caught_up_long = max(len(win) for win in windows) > self.k.k_max + 1
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        live = list(range(len(active)))
        logits = self.runner.forward(
            windows, starts, caches, [[len(win) - 1] for win in windows], kind=catch_up_kind(starts)
        )
        for _step in range(max(k for _, _, k in active)):
            for j, lg in zip(live, logits):
                _, w, _ = active[j]
                tok, q = self._choose(lg[-1], w, drafts[j])
                drafts[j].append(tok)
                if q is not None:
                    probs[j].append(q)
            live = [j for j in live if len(drafts[j]) < active[j][2]]
            if not live:
                break
            # Feed the tokens just proposed, one row per still-speculating request.
            rids = [active[j][1].request_id for j in live]
            logits = self.runner.forward(
                [[drafts[j][-1]] for j in live],
                [len(self.fed[r]) for r in rids],
                [self.caches[r] for r in rids],
                [[0]] * len(live),
                kind="decode",
            )
            for r, j in zip(rids, live):
                self.fed[r] = self.fed[r] + [drafts[j][-1]]
        work = list(plan.work)
        for j, (i, w, _) in enumerate(active):
            work[i] = with_drafts(w, drafts[j], torch.stack(probs[j]) if probs[j] else None)
        return StepPlan(work, plan.free_ids)

    def _choose(
        self, logits: torch.Tensor, w: SeqWork, proposed: list[int]
    ) -> tuple[int, torch.Tensor | None]:
        """The draft's proposal from its [V] logits; its distribution q when sampling."""
        req = w.req
        logits = process_logits(
            logits,
            req.params,
            w.output_ids,
            extra=proposed,
            presence=req.presence_penalty,
            frequency=req.frequency_penalty,
            eos_ids=self.eos_ids,
        )
        if req.params.greedy:
            return int(torch.argmax(logits)), None
        q = target_probs(logits, req.params)  # [V]
        if req.params.seed is None:
            return draw(q, self.generators[w.request_id]), q
        # A seeded request keeps a proposal only where it is the token the target draws at that position
        # (engine/worker/verify.py), with the uniform of the seed and the position: the draft draws with
        # that same uniform, so where q and the target's distribution agree around it, so do the tokens
        # (1.2 tokens a verification with the draft's own stream on the embedded pair at T = 0.8).
        at = len(history(w)) - 1 + len(proposed)  # the row that predicts this token
        return seeded_draw(q, req.params.seed, at), q


def catch_up_kind(starts: list[int]) -> str:
    """The runner's kind for a catch-up step, which picks its kernels (engine/native/row_kernels.py):
    a window from position 0 is a prompt and takes torch's kernels, as the target's prompt rows do;
    the few tokens confirmed since the last proposal take the few-row ones, as the target's
    verification rows do."""
    return "prefill" if 0 in starts else "verify"


def _draft_generator(w: SeqWork, device: torch.device) -> torch.Generator | None:
    """An unseeded sampling request's proposal stream (a seeded one draws by position: `_choose`)."""
    return make_generator(w.req.params, device) if w.req.params.seed is None else None


def _common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that a[:start] == b[:start]."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
