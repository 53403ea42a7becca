"""The policies `moe-offload eval --all-policies` compares, and the mass-hypothesis check."""

from __future__ import annotations

import math
from typing import Any

# label -> EngineConfig overrides. fetch-all first: it is the reference for ΔPPL.
POLICY_SWEEP: dict[str, dict[str, Any]] = {
    "fetch-all": {"policy": "fetch-all"},
    "threshold@0.05": {"policy": "threshold", "threshold": 0.05},
    "threshold": {"policy": "threshold"},
    "threshold@0.30": {"policy": "threshold", "threshold": 0.30},
    "threshold/drop": {"policy": "threshold", "substitute": "drop"},
    "first-choice": {"policy": "first-choice"},
    "first-choice/drop": {"policy": "first-choice", "substitute": "drop"},
    "threshold-noprotect@0.30": {"policy": "threshold-noprotect", "threshold": 0.30},
    "quality-first": {"policy": "quality-first"},
    "speed-first": {"policy": "speed-first"},
}
UNPROTECTED = {"threshold-noprotect@0.30"}  # do not always fetch the first choice


def pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")
