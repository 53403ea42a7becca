"""Experiment B of seed 000: the same substituted gate mass, made of a few heavy substitutions or of
many light ones.

An emulation policy, not a serving one: it substitutes chosen router slots whether or not their
experts are resident (the paper's emulation idealizes fetch latency), so the composition of the
substituted mass is the only thing that differs between its two modes. Every other slot is served
exactly (a hit, or a load). The first choice is never substituted, as in the rules whose mass the
paper compares, unless `heavy_rank` is 0 (the paper's heavy misses are the first choice or a gate of
0.15 or more).

- heavy: substitute the slot at `heavy_rank` (1: the router's second choice; 0: its first), one call;
- light: substitute slots from the lightest upwards (never the first choice nor the heavy slot)
  while that brings their summed mass closer to the heavy slot's: several calls, equal mass.
Rows where no set of at least two light slots comes within MASS_TOLERANCE of the heavy slot's
mass substitute nothing in either mode, so both modes touch the same rows with the same mass.

The stand-in is the router's best-ranked expert not already in the row (as `best-resident` picks,
without the residency condition: a stand-in that is not resident is loaded). A substituted call
counts as a substitution only, never also as a hit or a fetch, as in the substituting rules.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from policies.base import ExpertPlan, MissPolicy

MODES = ("heavy", "light")
# A row is used only where its light slots sum to the heavy slot's mass within this share of it.
MASS_TOLERANCE = 0.25


def light_slots(normalized: Sequence[float], target: float, exclude: Collection[int]) -> list[int]:
    """Slots taken from the lightest upwards, skipping `exclude`, while adding the next one brings
    their summed mass closer to `target` (never further). Returns them lightest first."""
    order = sorted(
        (j for j in range(len(normalized)) if j not in exclude), key=lambda j: normalized[j]
    )
    chosen: list[int] = []
    total = 0.0
    for j in order:
        if abs(total + normalized[j] - target) >= abs(total - target):
            break
        chosen.append(j)
        total += normalized[j]
    return chosen


def composed_slots(
    normalized: Sequence[float], mode: str, heavy_rank: int = 1, tolerance: float = MASS_TOLERANCE
) -> list[int]:
    """The slots a row substitutes in `mode`: the heavy one, or the light ones of about its mass.
    Both modes skip a row (substitute nothing) where the light slots' mass differs from the heavy
    slot's by more than `tolerance` of it, or where the row has no heavy slot: so the two modes
    substitute the same rows, with about the same mass in each."""
    if heavy_rank < 0:
        raise ValueError(f"heavy_rank must be >= 0, got {heavy_rank}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if len(normalized) <= heavy_rank:
        return []
    heavy = normalized[heavy_rank]
    light = light_slots(normalized, heavy, exclude={0, heavy_rank})
    if len(light) < 2 or abs(sum(normalized[j] for j in light) - heavy) > tolerance * heavy:
        return []
    return [heavy_rank] if mode == "heavy" else light


class CompositionPolicy(MissPolicy):
    """Experiment B's miss policy (see the module docstring); needs the router's ranking."""

    needs_logits = True

    def __init__(self, mode: str, heavy_rank: int = 1, tolerance: float = MASS_TOLERANCE) -> None:
        composed_slots([1.0] * (heavy_rank + 1), mode, heavy_rank)  # validates both arguments
        self.mode, self.heavy_rank, self.tolerance = mode, heavy_rank, tolerance
        self.name = f"compose-{mode}@{heavy_rank}"

    def plan(
        self,
        layer: int,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
        is_resident: Callable[[int], bool],
        logits: Sequence[Sequence[float]] | None = None,
    ) -> ExpertPlan:
        assert logits is not None, "the composition policy needs the router's ranking"
        out_e: list[list[int]] = []
        fetch: set[int] = set()
        substituted: list[tuple[int, float]] = []
        hit = fetched = 0
        for row, wrow, lrow in zip(experts, weights, logits):
            total = sum(wrow) or 1.0
            normalized = [w / total for w in wrow]
            new_row = list(row)
            swap = set(composed_slots(normalized, self.mode, self.heavy_rank, self.tolerance))
            ranking = sorted(range(len(lrow)), key=lrow.__getitem__, reverse=True)
            for j, e in enumerate(row):
                if j in swap:
                    # Never an expert of the router's row: not one kept, nor one substituted away.
                    stand_in = next(c for c in ranking if c not in new_row and c not in row)
                    new_row[j] = stand_in  # it takes the missed expert's gate weight
                    substituted.append((e, normalized[j]))
                    if not is_resident(stand_in):
                        fetch.add(stand_in)  # loaded, but counted as a substitution, not a fetch
                elif is_resident(e):
                    hit += 1
                else:
                    fetch.add(e)
                    fetched += 1
            out_e.append(new_row)
        return ExpertPlan(
            out_e, [list(w) for w in weights], sorted(fetch), substituted, hit, fetched
        )
