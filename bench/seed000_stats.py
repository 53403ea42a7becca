"""The pure arithmetic of seed 000's experiments: matching substitution shares, and correlations.

Matching shares. The paper contrasts the 0.15 rule (first choice protected) with a rule that does not
protect the heavy experts *at a similar substituted share* (7.5 % against 8.5 %). The unprotected
rule here is `threshold-noprotect@t`: it substitutes every miss whose normalized gate is below t.
Which t gives a share of calls equal to the protected rule's is found from the router's gates:
a rule substitutes (share of calls that miss) x (share of the calls it would substitute if they
missed). The second factor comes from a router trace of the same tokens; the first is read off a
measured run (`miss_factor`), which makes the next guess (`cutoff_for_measured_share`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cli.policy_sweep import pearson


def normalized_gates(weights: np.ndarray) -> np.ndarray:
    """[..., k] router weights -> the same, each row summing to 1 (the rules' normalized gates)."""
    w = np.asarray(weights, dtype=np.float64)
    return w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-12)


def protected_gate_share(gates: np.ndarray, cutoff: float) -> float:
    """Share of calls the protected threshold rule would substitute if they missed: not the first
    choice (slot 0 of a row, the router's order) and a normalized gate below `cutoff`."""
    rest = gates[..., 1:]
    return float((rest < cutoff).sum()) / gates.size


def unprotected_gate_share(gates: np.ndarray, cutoff: float) -> float:
    """Share of calls the unprotected rule would substitute if they missed: gate below `cutoff`."""
    return float((gates < cutoff).sum()) / gates.size


def cutoff_for_share(gates: np.ndarray, share: float) -> float:
    """The cutoff t with about `share` of all calls' gates below it (clipped to [0, 1])."""
    flat = np.sort(gates.ravel())
    if share <= 0:
        return 0.0
    if share >= 1:
        return 1.0
    return float(flat[min(int(round(share * flat.size)), flat.size - 1)])


def miss_factor(measured_share: float, eligible_share: float) -> float:
    """Measured substituted share over the share of calls the rule would substitute if they all
    missed: the share of those calls that did miss (about the miss rate)."""
    return measured_share / eligible_share if eligible_share > 0 else 1.0


def cutoff_for_measured_share(
    gates: np.ndarray, target_share: float, measured_share: float, eligible_share: float
) -> float:
    """The next unprotected cutoff: the one whose eligible share, times the miss factor measured on a
    run, equals `target_share`."""
    k = miss_factor(measured_share, eligible_share)
    return cutoff_for_share(gates, min(target_share / k, 1.0) if k > 0 else 1.0)


def mass_r(rows: Sequence[dict]) -> float:
    """Pearson r between mean substituted mass and ΔPPL % over `rows` (nan under three rows)."""
    if len(rows) < 3:
        return float("nan")
    return pearson([r["mean_substituted_mass"] for r in rows], [r["delta_ppl_pct"] for r in rows])


def within_input_r(mass: Sequence[Sequence[float]], dnll: Sequence[Sequence[float]]) -> list[float]:
    """Per input (window), Pearson r across policies between substituted mass and ΔNLL.
    mass[p][w], dnll[p][w]: policy p, window w. The paper's claim is about the same input."""
    windows = len(mass[0]) if mass else 0
    out = []
    for w in range(windows):
        r = pearson([m[w] for m in mass], [d[w] for d in dnll])
        if not math.isnan(r):
            out.append(r)
    return out


def across_input_r(mass: Sequence[float], dnll: Sequence[float]) -> float:
    """For one policy, Pearson r across inputs (windows): does more mass mark the inputs that lose
    more? The paper reports it does not."""
    return pearson(list(mass), list(dnll)) if len(mass) >= 3 else float("nan")


def bracket(tries: Sequence[dict], target: float) -> tuple[dict, dict] | None:
    """The tries nearest `target` substitution share from below and from above, or None."""
    below = [t for t in tries if t["substitution_share"] <= target]
    above = [t for t in tries if t["substitution_share"] > target]
    if not below or not above:
        return None
    lo = max(below, key=lambda t: t["substitution_share"])
    hi = min(above, key=lambda t: t["substitution_share"])
    return lo, hi


def interpolate_cutoff(lo: dict, hi: dict, target: float) -> float:
    """Regula falsi: the cutoff at `target` share on the line through two bracketing tries."""
    s0, s1 = lo["substitution_share"], hi["substitution_share"]
    f = (target - s0) / (s1 - s0) if s1 > s0 else 0.5
    return lo["cutoff"] + f * (hi["cutoff"] - lo["cutoff"])


def at_share(tries: Sequence[dict], target: float, key: str = "delta_ppl_pct") -> float | None:
    """`key` interpolated linearly in substitution share at `target`, between the bracketing tries
    (None when no two tries bracket it)."""
    b = bracket(tries, target)
    if b is None:
        return None
    lo, hi = b
    s0, s1 = lo["substitution_share"], hi["substitution_share"]
    f = (target - s0) / (s1 - s0) if s1 > s0 else 0.0
    return lo[key] + f * (hi[key] - lo[key])
