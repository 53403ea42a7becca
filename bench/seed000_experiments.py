"""Seed 000's experiments, each a function returning the rows its table prints (bench/seed_000.py
runs them, bench/seed000_page.py renders them). All teacher-forced, deterministic, on one model."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.seed000_runs import Run, Scored, Setup, score, score_all
from bench.seed000_stats import (
    across_input_r,
    bracket,
    cutoff_for_measured_share,
    interpolate_cutoff,
    mass_r,
    protected_gate_share,
    unprotected_gate_share,
    within_input_r,
)
from cli.policy_sweep import POLICY_SWEEP

# The policy table: the project's sweep (cli/policy_sweep.py, as `moe-offload eval --all-policies`
# runs it) plus more cut-offs for the mass correlation and the admission/eviction ablation.
SWEEP = [Run(label, dict(over)) for label, over in POLICY_SWEEP.items()] + [
    Run("threshold@0.10", {"policy": "threshold", "threshold": 0.10}),
    Run("threshold@0.20", {"policy": "threshold", "threshold": 0.20}),
]
# Background admission on its own: the eviction held fixed, admission on or off.
ADMISSION = [
    Run("threshold + background", {"policy": "threshold", "admission": "background"}),
    Run("threshold + frequency", {"policy": "threshold", "eviction": "frequency"}),
    Run("first-choice + background", {"policy": "first-choice", "admission": "background"}),
    Run("first-choice + frequency", {"policy": "first-choice", "eviction": "frequency"}),
]
# (eviction, admission) -> label, for the 2 x 2 tables of each rule.
ABLATION = {
    "threshold": {
        ("reuse", "none"): "threshold",
        ("reuse", "background"): "threshold + background",
        ("frequency", "none"): "threshold + frequency",
        ("frequency", "background"): "quality-first",
    },
    "first-choice": {
        ("reuse", "none"): "first-choice",
        ("reuse", "background"): "first-choice + background",
        ("frequency", "none"): "first-choice + frequency",
        ("frequency", "background"): "speed-first",
    },
}
# Experiment B: heavy slot -> (its rank, the heavy run's label, the light run's label).
B_PAIRS = {
    "2nd choice": (1, "B: heavy = 2nd choice", "B: light, same rows and mass (2nd)"),
    "1st choice": (0, "B: heavy = 1st choice", "B: light, same rows and mass (1st)"),
}
COMPOSE = [
    Run(label, compose=(mode, rank))
    for rank, *labels in B_PAIRS.values()
    for label, mode in zip(labels, ("heavy", "light"))
]
SHIFT_RUNS = ["fetch-all", "threshold", "threshold + background", "quality-first"]
UNPROTECTED = "threshold-noprotect@0.30"


def policy_table(setup: Setup, chunks: list[list[int]]) -> dict[str, Scored]:
    return score_all(setup, SWEEP + ADMISSION + COMPOSE, chunks)


def rows(scored: dict[str, Scored]) -> list[dict[str, Any]]:
    ref = scored["fetch-all"]
    return [s.row(ref) for s in scored.values()]


def matched_contrast(
    setup: Setup,
    chunks: list[list[int]],
    gates: np.ndarray,
    protected: dict[str, Any],
    cutoff: float,
    ref: Scored,
    tolerance: float,
    max_tries: int,
) -> list[dict[str, Any]]:
    """The unprotected rule at the protected rule's substitution share. Each try's cutoff: from the
    gates of a router trace and the miss factor measured on the previous run (seed000_stats.py),
    and once two tries bracket the share, on the line through them (regula falsi)."""
    target = protected["substitution_share"]
    measured, eligible = target, protected_gate_share(gates, cutoff)
    tries: list[dict[str, Any]] = []
    for _ in range(max_tries):
        b = bracket(tries, target)
        t = round(
            interpolate_cutoff(*b, target)
            if b
            else cutoff_for_measured_share(gates, target, measured, eligible),
            4,
        )
        run = Run(f"threshold-noprotect@{t:.4f}", {"policy": "threshold-noprotect", "threshold": t})
        row = {**score(setup, run, chunks).row(ref), "cutoff": t, "target_share": target}
        tries.append(row)
        measured, eligible = row["substitution_share"], unprotected_gate_share(gates, t)
        if abs(measured - target) <= tolerance:
            break
    return tries


def experiment_b(scored: dict[str, Scored]) -> list[dict[str, Any]]:
    """Per pair: both rows, and in how many windows the heavy run's NLL exceeds the light run's
    (a paired count: the two runs score the same tokens)."""
    ref, out = scored["fetch-all"], []
    for name, (_, h, l) in B_PAIRS.items():
        hs, ls = scored[h], scored[l]
        worse = sum(a > b for a, b in zip(hs.nll, ls.nll))
        out.append(
            {
                "heavy_slot": name,
                "heavy": hs.row(ref),
                "light": ls.row(ref),
                "heavy_worse_windows": worse,
                "windows": len(hs.nll),
            }
        )
    return out


def admission_tables(table: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per rule, the 2 x 2 of eviction and admission, each cell the policy table's row."""
    by = {r["label"]: r for r in table}
    return {
        rule: [{"eviction": e, "admission": a, **by[label]} for (e, a), label in cells.items()]
        for rule, cells in ABLATION.items()
    }


def topic_shift(
    setup: Setup, chunks: list[list[int]], per_domain: int, first_after: int
) -> dict[str, Any]:
    """ΔPPL before the shift, in the first `first_after` windows after it, and in the rest."""
    scored = score_all(setup, [r for r in SWEEP + ADMISSION if r.label in SHIFT_RUNS], chunks)
    ref = scored["fetch-all"]
    parts = {
        "before the shift": slice(0, per_domain),
        f"first {first_after} window(s) after": slice(per_domain, per_domain + first_after),
        "rest after": slice(per_domain + first_after, 2 * per_domain),
    }
    out = []
    for label, s in scored.items():
        if label == "fetch-all":
            continue
        for part, sl in parts.items():
            if sl.start < sl.stop:
                out.append({"part": part, **s.row(ref, sl)})
    per_window = {
        label: [
            100.0 * (s.ppl(slice(w, w + 1)) / ref.ppl(slice(w, w + 1)) - 1)
            for w in range(len(chunks))
        ]
        for label, s in scored.items()
        if label != "fetch-all"
    }
    return {"rows": out, "per_window_delta_ppl_pct": per_window}


def mass_hypothesis(scored: dict[str, Scored], table: list[dict[str, Any]]) -> dict[str, Any]:
    """Pearson r of mass against ΔPPL across policies (all first-choice-protecting rows; the
    best-resident ones; the paper's framing), within each input, and across inputs."""
    ref = scored["fetch-all"]
    # Experiment B's emulation rows are left out: they are not cache policies.
    protecting = [r for r in table if r["label"] != UNPROTECTED and not r["label"].startswith("B:")]
    best_resident = [r for r in protecting if "/drop" not in r["label"]]
    labels = [r["label"] for r in best_resident if r["label"] != "fetch-all"]
    deltas = {lab: scored[lab].window_deltas(ref) for lab in labels}
    within = within_input_r([deltas[lab][0] for lab in labels], [deltas[lab][1] for lab in labels])
    return {
        "r_protecting": mass_r(protecting),
        "n_protecting": len(protecting),
        "r_best_resident": mass_r(best_resident),
        "n_best_resident": len(best_resident),
        "within_input_r_median": float(np.median(within)) if within else float("nan"),
        "within_input_n": len(within),
        "across_input_r": {
            lab: across_input_r(*deltas[lab]) for lab in ("threshold", "first-choice")
        },
    }
