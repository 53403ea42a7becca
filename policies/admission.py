"""Background admission: bring an expert into the cache once substitutions show it is wanted."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import AdmissionPolicy


class NoAdmission(AdmissionPolicy):
    name = "none"

    def observe(self, layer: int, substituted: Sequence[tuple[int, float]]) -> list[int]:
        return []


class BackgroundAdmission(AdmissionPolicy):
    """Accumulate each substituted expert's normalized gate mass; once it reaches beta, admit
    the expert (the engine loads it asynchronously, never blocking compute) and start over.

    The paper's beta = 0.5: an expert is admitted after it has been substituted for about
    half a token's worth of routing mass in total.
    """

    name = "background"

    def __init__(self, beta: float = 0.5) -> None:
        if beta <= 0:
            raise ValueError(f"admission beta must be > 0, got {beta}")
        self.beta = beta
        self.mass: dict[tuple[int, int], float] = {}

    def observe(self, layer: int, substituted: Sequence[tuple[int, float]]) -> list[int]:
        admit: list[int] = []
        for expert, m in substituted:
            key = (layer, expert)
            total = self.mass.get(key, 0.0) + m
            if total >= self.beta:
                self.mass.pop(key, None)
                if expert not in admit:
                    admit.append(expert)
            else:
                self.mass[key] = total
        return admit
