"""Seed 000's protection contrast (section 2): the unprotected rule at a protected rule's substitution
share, for each protected cutoff asked (`--contrast-cutoffs`).

The full page's run measures it at the cutoffs it is given (by default the 0.15 rule's, where this
model's flat gates substitute a third of calls). `--only-contrast` measures further cutoffs on their
own and merges them into the page's JSON, for the paper's kind of share (7.5 %) without rerunning the
page: fetch-all is scored again on the same windows and must score what the JSON's fetch-all scored
(the same tokens), or the run stops; a protected rule the policy table lacks is scored too.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from bench.seed000_experiments import matched_contrast
from bench.seed000_runs import Run, Scored, Setup, score_all, spread_windows, tokenize
from bench.seed000_stats import normalized_gates


def contrast_label(cutoff: float) -> str:
    """The policy table's label of the 0.15 rule at `cutoff`."""
    return "threshold" if cutoff == 0.15 else f"threshold@{cutoff:.2f}"


def cutoffs(args: argparse.Namespace) -> list[float]:
    return [float(x) for x in args.contrast_cutoffs.split(",")]


def router_trace(setup: Setup, chunks: list[list[int]], window: int) -> dict[str, Any]:
    """The router's trace on the windows (batched at cache 1.0: routing does not depend on the cache):
    its normalized gates give each contrast try its first cutoff."""
    from engine import EngineConfig, load_model, record_trace

    om = load_model(setup.model_dir, EngineConfig(cache_fraction=1.0, prefetch="none"))
    try:
        return record_trace(om, [t for c in chunks for t in c], window, logits=True)
    finally:
        om.close()


def protected_rows(
    args: argparse.Namespace,
    setup: Setup,
    chunks: list[list[int]],
    known: dict[str, dict[str, Any]],
    ref: Scored,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(each protected cutoff's row by label, the rows scored here for cutoffs `known` lacks): the
    policy table has 0.05, 0.10, 0.15, 0.20 and 0.30; another cutoff is scored apart."""
    missing = [
        Run(contrast_label(c), {"policy": "threshold", "threshold": c})
        for c in cutoffs(args)
        if contrast_label(c) not in known
    ]
    apart = {k: s.row(ref) for k, s in score_all(setup, missing, chunks).items()} if missing else {}
    return {**known, **apart}, apart


def contrasts(
    args: argparse.Namespace,
    setup: Setup,
    chunks: list[list[int]],
    gates: np.ndarray,
    protected: dict[str, dict[str, Any]],
    ref: Scored,
) -> dict[str, list[dict[str, Any]]]:
    """Per protected cutoff: the unprotected rule's tries at that rule's share (`protected`: its row by label)."""
    return {
        contrast_label(c): matched_contrast(
            setup,
            chunks,
            gates,
            protected[contrast_label(c)],
            c,
            ref,
            args.match_tolerance,
            args.match_tries,
        )
        for c in cutoffs(args)
    }


def only_contrast(args: argparse.Namespace, setup: Setup, result: dict[str, Any]) -> None:
    """Measure the contrast at `--contrast-cutoffs` and merge it into `result` (the page's JSON): the
    tries under "contrast", the protected rules' rows under "contrast_protected", the run's cutoffs
    under "contrast_runs"."""
    chunks = spread_windows(tokenize(setup.model_dir, args.data), args.tokens, args.window)
    ref = score_all(setup, [Run("fetch-all", {"policy": "fetch-all"})], chunks)["fetch-all"]
    before = next(r for r in result["table"] if r["label"] == "fetch-all")
    if not math.isclose(ref.ppl(), before["ppl"], rel_tol=1e-9):
        raise SystemExit(
            f"seed-000 --only-contrast: fetch-all scores PPL {ref.ppl():.4f} here against "
            f"{before['ppl']:.4f} in the JSON; give the --data, --tokens and --window it was made "
            "with (or the engine's numbers changed since: rerun the page)"
        )
    # The JSON's policy table was scored on these windows (fetch-all agrees): its rows are the protected
    # rules' where it has them.
    known = {r["label"]: r for r in result["table"]}
    protected, apart = protected_rows(args, setup, chunks, known, ref)
    gates = normalized_gates(router_trace(setup, chunks, args.window)["weights"])
    result["contrast"].update(contrasts(args, setup, chunks, gates, protected, ref))
    result.setdefault("contrast_protected", {}).update(apart)
    # the page's Command line names the cutoffs of each run of its own
    result.setdefault("contrast_runs", []).append(args.contrast_cutoffs)
