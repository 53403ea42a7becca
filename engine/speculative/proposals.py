"""Shared pieces of the proposers: which windows speculate, and how proposals enter a plan."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from engine.core.step_types import SeqResult, SeqWork, StepOutput, StepPlan
from engine.stats import EngineStats
from policies.adaptive_k import AdaptiveK


def history(w: SeqWork) -> list[int]:
    """Every token of the request so far: prompt + output (the last one not yet in the KV cache)."""
    return list(w.req.prompt_ids) + list(w.output_ids)


def with_drafts(w: SeqWork, drafts: list[int], probs: torch.Tensor | None = None) -> SeqWork:
    if not drafts:
        return w
    return replace(w, input_ids=w.input_ids + drafts, num_draft=len(drafts), draft_probs=probs)


def _decode_batch(plan: StepPlan) -> int:
    """Decode windows in the step; 0 when a prompt chunk shares it (its time says nothing about rows)."""
    if any(w.is_prefill for w in plan.work):
        return 0
    return len(plan.work)


class ProposerBase:
    """Chooses k per request (AdaptiveK), records acceptance, and fills the spec counters.

    Subclasses implement `_propose`; `propose` times it, so that the cost of proposing one
    token, relative to the target's step, feeds adaptive k (policies/adaptive_k.py).
    """

    def __init__(self, k: AdaptiveK, stats: EngineStats | None) -> None:
        self.k = k
        self.stats = stats
        self._propose_s = 0.0
        # Set by `_propose` where this step's proposing also caught the proposer up on more tokens than
        # a window confirms (a request's prompt, or the tokens of a stretch decoded without proposals):
        # its time is then no measure of what one proposed token costs, and is not observed.
        self._caught_up_long = False

    def propose(self, plan: StepPlan) -> StepPlan:
        self.k.begin_step(_decode_batch(plan))
        self._caught_up_long = False
        t0 = time.perf_counter()
        out = self._propose(plan)
        self._propose_s = time.perf_counter() - t0
        return out

    def _propose(self, plan: StepPlan) -> StepPlan:
        raise NotImplementedError

    def budget(self, w: SeqWork) -> int:
        """Proposals for this window: 0 for prefills and requests near their end."""
        if w.is_prefill or not w.samples or w.max_draft <= 0:
            return 0
        return min(self.k.k_for(w.request_id), w.max_draft)

    def forget(self, request_id: str) -> None:
        self.k.forget(request_id)

    def observe(self, plan: StepPlan, out: StepOutput) -> None:
        for rid in plan.free_ids:
            self.forget(rid)
        deepest = max((w.num_draft for w in plan.work), default=0)
        self.k.observe_step(_decode_batch(plan), sum(w.num_draft for w in plan.work), out.seconds)
        if deepest and out.seconds > 0 and not self._caught_up_long:
            # Proposing runs `deepest` sequential draft steps for the whole batch: one of them is
            # the cost of one more proposed token.
            self.k.observe_proposal_time(
                _decode_batch(plan), self._propose_s / deepest, out.seconds
            )
        for w in plan.work:
            res: SeqResult | None = out.results.get(w.request_id)
            if w.num_draft == 0 or res is None or res.error is not None:
                continue
            accepted = len(res.sampled) - 1
            self.k.observe(w.request_id, w.num_draft, accepted)
            if self.stats is not None:
                self.stats.record_window(w.num_draft, accepted)
