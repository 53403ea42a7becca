"""SpecPrefetch's window-aware transfer scheduler: which predicted experts of layer l+1 to
prefetch, in which order, while layer l runs.

Each candidate carries the predictor's confidence (for a window of several rows, the best row's:
the window needs the union of its rows' experts). Candidates already resident or already on
their way are skipped. The rest are taken in confidence order and each gets an estimated landing
time, behind the transfers already queued, at the measured copy time with `workers` copies in
flight. Its score is its confidence, scaled by LATE_WEIGHT when it cannot land before layer l+1
starts: a right but late prefetch still shortens the demand wait it replaces, but a wrong one
holds a transfer worker that a demand load may need, so a late guess must be surer to pay.
Candidates scoring at least `min_confidence` are submitted, best first, at most `budget`.
Pure: numbers in, expert ids out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

LATE_WEIGHT = 0.7  # score scale of a prefetch that would land after layer l+1 starts (with the
#                   engine's 0.5 threshold, a late guess needs a confidence of about 0.71)


@dataclass(frozen=True)
class PrefetchCandidate:
    expert: int
    confidence: float  # the predictor's probability that layer l+1 routes a row to this expert


def schedule_prefetches(
    candidates: Sequence[PrefetchCandidate],
    is_resident: Callable[[int], bool],
    is_pending: Callable[[int], bool],
    copy_seconds: float,
    workers: int,
    queued: int,
    time_to_next: float,
    budget: int,
    min_confidence: float = 0.0,
) -> list[int]:
    """The experts to prefetch for the next layer, in submission order (at most `budget`)."""
    live = [
        c
        for c in sorted(candidates, key=lambda c: (-c.confidence, c.expert))
        if c.confidence >= min_confidence and not is_resident(c.expert) and not is_pending(c.expert)
    ]
    scored = []
    for i, c in enumerate(live):
        lands_in = math.ceil((queued + i + 1) / max(1, workers)) * copy_seconds
        score = c.confidence * (1.0 if lands_in <= time_to_next else LATE_WEIGHT)
        if score >= min_confidence:
            scored.append((score, c.expert))
    scored.sort(key=lambda p: (-p[0], p[1]))
    return [e for _, e in scored[: max(0, budget)]]
