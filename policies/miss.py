"""Miss policies: fetch-all (exact), the 0.15 threshold rule and the first-choice rule."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from policies.base import DROPPED, ExpertPlan, MissPolicy, SubstituteChoice


class FetchAll(MissPolicy):
    """Wait for every missing expert: the exact reference."""

    name = "fetch-all"

    def plan(self, layer, experts, weights, is_resident, logits=None) -> ExpertPlan:
        needed = {e for row in experts for e in row}
        fetch = sorted(e for e in needed if not is_resident(e))
        if not fetch:  # all resident (cache 1.0, or all hits): the common decode step, kept short
            return ExpertPlan(
                experts, None, fetch, calls_hit=sum(map(len, experts)), calls_fetched=0
            )
        missing = set(fetch)
        fetched_calls = sum(e in missing for row in experts for e in row)
        total = sum(len(row) for row in experts)
        return ExpertPlan(
            experts, None, fetch, calls_hit=total - fetched_calls, calls_fetched=fetched_calls
        )


class SubstitutingPolicy(MissPolicy):
    """Base for rules that wait for some misses and substitute the rest.

    Subclasses say which misses are worth waiting for (`must_fetch`); a SubstituteChoice
    says what stands in for the others.
    """

    def __init__(self, substitute: SubstituteChoice) -> None:
        self.substitute = substitute
        self.needs_logits = substitute.needs_logits

    def must_fetch(self, rank: int, normalized_weight: float) -> bool:
        raise NotImplementedError

    def plan(
        self,
        layer: int,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
        is_resident: Callable[[int], bool],
        logits: Sequence[Sequence[float]] | None = None,
    ) -> ExpertPlan:
        out_e: list[list[int]] = []
        out_w: list[list[float]] = []
        fetch: set[int] = set()
        substituted: list[tuple[int, float]] = []
        hit = fetched = 0
        for t, (row, wrow) in enumerate(zip(experts, weights)):
            total = sum(wrow) or 1.0
            new_row, new_w = list(row), list(wrow)
            dropped = 0.0
            ranking: list[int] | None = None  # computed once per row, only if a miss is substituted
            for j, (e, w) in enumerate(zip(row, wrow)):
                if is_resident(e):
                    hit += 1
                    continue
                stand_in = None
                if not self.must_fetch(j, w / total):
                    if ranking is None and logits is not None:
                        lrow = logits[t]
                        ranking = sorted(range(len(lrow)), key=lrow.__getitem__, reverse=True)
                    stand_in = self.substitute.choose(new_row, j, ranking, is_resident)
                if stand_in is None:
                    fetch.add(e)
                    fetched += 1
                    continue
                substituted.append((e, w / total))
                new_row[j] = stand_in
                if stand_in == DROPPED:
                    new_w[j] = 0.0
                    dropped += w
            if dropped:
                # Renormalize the surviving gates so the row keeps its total gate mass.
                scale = total / (total - dropped) if total > dropped else 0.0
                new_w = [w * scale for w in new_w]
            out_e.append(new_row)
            out_w.append(new_w)
        if not substituted:
            return ExpertPlan(experts, None, sorted(fetch), calls_hit=hit, calls_fetched=fetched)
        return ExpertPlan(out_e, out_w, sorted(fetch), substituted, hit, fetched)


class ThresholdPolicy(SubstitutingPolicy):
    """The 0.15 rule: wait for a miss if it is the first choice or its normalized gate >= threshold."""

    name = "threshold"

    def __init__(
        self, substitute: SubstituteChoice, threshold: float = 0.15, protect_first: bool = True
    ) -> None:
        super().__init__(substitute)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self.protect_first = protect_first
        if not protect_first:
            self.name = "threshold-noprotect"

    def must_fetch(self, rank: int, normalized_weight: float) -> bool:
        return (rank == 0 and self.protect_first) or normalized_weight >= self.threshold


class FirstChoicePolicy(SubstitutingPolicy):
    """Wait only for first-choice misses; substitute every other miss."""

    name = "first-choice"

    def must_fetch(self, rank: int, normalized_weight: float) -> bool:
        return rank == 0
