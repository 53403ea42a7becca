"""Prompt lookup (n-gram) proposals: no model, just the request's own tokens.

If the last n tokens (n = ngram_max .. 1) occurred earlier in the prompt or the output, the
tokens that followed that earlier occurrence are proposed. Repetitive text (code, quoting the
prompt, lists) is where this pays; elsewhere adaptive k turns it off.
"""

from __future__ import annotations

from engine.core.step_types import StepPlan
from engine.speculative.proposals import ProposerBase, history, with_drafts


def lookup(tokens: list[int], k: int, ngram_max: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest matching suffix."""
    L = len(tokens)
    for n in range(min(ngram_max, L - 1), 0, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # latest occurrence first, not the suffix itself
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(ProposerBase):
    def __init__(self, k, stats, ngram_max: int = 3) -> None:
        super().__init__(k, stats)
        self.ngram_max = ngram_max

    def _propose(self, plan: StepPlan) -> StepPlan:
        work = []
        for w in plan.work:
            k = self.budget(w)
            work.append(with_drafts(w, lookup(history(w), k, self.ngram_max)) if k else w)
        return StepPlan(work, plan.free_ids)
