"""fetch-all: wait for every missing expert. The exact reference policy."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from policies.base import ExpertPlan, MissPolicy


class FetchAll(MissPolicy):
    name = "fetch-all"

    def plan(
        self,
        layer: int,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
        is_resident: Callable[[int], bool],
    ) -> ExpertPlan:
        needed = sorted({e for row in experts for e in row})
        return ExpertPlan(experts=experts, weights=None, fetch=[e for e in needed if not is_resident(e)])
