"""Seed 000's quality runs: teacher-forced perplexity per policy, kept per window.

Each run loads the model with one policy (prefetch off, background loads settled before each MoE
layer plans, as `moe-offload eval` runs by default, so the numbers are deterministic) and scores the
same windows token by token with the project's evaluator (engine/offline/evaluation.py
`score_window`). The counters are read per window so that one run gives both the aggregate row
and the per-window figures the topic-shift and mass-correlation experiments need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from engine import EngineConfig, ModelRunner, load_model, score_window
from policies.composition import CompositionPolicy

COUNTERS = ("calls_hit", "calls_fetched", "substitutions", "substituted_mass", "admissions")


@dataclass(frozen=True)
class Run:
    """One row: a label, the EngineConfig settings it overrides, and optionally experiment B's
    composition policy (installed in place of the configured miss policy)."""

    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    compose: tuple[str, int] | None = (
        None  # ("heavy" or "light", heavy rank): policies/composition.py
    )


@dataclass
class Scored:
    """One run's per-window NLL sums, token counts and counter deltas."""

    label: str
    nll: list[float]
    tokens: list[int]
    counters: list[dict[str, float]]
    layers: int  # MoE layers: token-layers = tokens x layers

    def total(self, key: str, windows: slice = slice(None)) -> float:
        return sum(c[key] for c in self.counters[windows])

    def ppl(self, windows: slice = slice(None)) -> float:
        return math.exp(sum(self.nll[windows]) / max(sum(self.tokens[windows]), 1))

    def row(self, ref: Scored, windows: slice = slice(None)) -> dict[str, Any]:
        """The evaluation protocol's row (DESIGN.md §5), against the reference run `ref`."""
        n = sum(self.tokens[windows])
        calls = sum(self.total(k, windows) for k in ("calls_hit", "calls_fetched", "substitutions"))
        return {
            "label": self.label,
            "tokens": n,
            "ppl": self.ppl(windows),
            "delta_ppl_pct": 100.0 * (self.ppl(windows) / ref.ppl(windows) - 1.0),
            "substitution_share": self.total("substitutions", windows) / calls if calls else 0.0,
            "mean_substituted_mass": self.total("substituted_mass", windows) / (n * self.layers),
            "fetches_per_token": self.total("calls_fetched", windows) / n,
            "admissions": int(self.total("admissions", windows)),
        }

    def window_deltas(self, ref: Scored) -> tuple[list[float], list[float]]:
        """Per window: (mean substituted mass per token-layer, ΔNLL per token against ref)."""
        mass = [
            c["substituted_mass"] / (n * self.layers) for c, n in zip(self.counters, self.tokens)
        ]
        dnll = [(a - b) / n for a, b, n in zip(self.nll, ref.nll, self.tokens)]
        return mass, dnll


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    cache_fraction: float


def engine_config(setup: Setup, run: Run) -> EngineConfig:
    base = EngineConfig(
        cache_fraction=setup.cache_fraction, prefetch="none", settle_background=True
    )
    return replace(base, **run.overrides)


def score(setup: Setup, run: Run, chunks: list[list[int]]) -> Scored:
    """Score `chunks` (one window each) under `run`, counters per window."""
    om = load_model(setup.model_dir, engine_config(setup, run))
    try:
        if run.compose:
            om.executor.policy = CompositionPolicy(*run.compose)
        runner = ModelRunner(om)
        out = Scored(run.label, [], [], [], len(om.moe_layers))
        for chunk in tqdm(chunks, desc=run.label, unit="window", leave=False):
            before = om.stats.snapshot()
            out.nll.append(score_window(runner, chunk))
            after = om.stats.snapshot()
            out.tokens.append(len(chunk) - 1)
            out.counters.append({k: after[k] - before[k] for k in COUNTERS})
        return out
    finally:
        om.close()


def spread_windows(ids: list[int], tokens: int, window: int) -> list[list[int]]:
    """About `tokens` tokens as whole windows spread evenly over `ids` (as `moe-offload eval`
    --max-tokens picks them, so a multi-domain split is represented)."""
    n = max(1, min(tokens, len(ids)) // window)
    stride = (len(ids) - window) // max(n - 1, 1) if n > 1 else 0
    return [ids[i * stride : i * stride + window] for i in range(n)]


def shift_windows(
    first: list[int], second: list[int], per_domain: int, window: int
) -> list[list[int]]:
    """A text that switches domain mid-way: `per_domain` consecutive windows of `first`, then as
    many of `second` (consecutive text, so the expert cache carries one domain into the other)."""
    a = [first[i * window : (i + 1) * window] for i in range(per_domain)]
    b = [second[i * window : (i + 1) * window] for i in range(per_domain)]
    if any(len(c) < window for c in a + b):
        raise ValueError(f"too little text for {per_domain} windows of {window} tokens per domain")
    return a + b


def tokenize(model_dir: Path, path: str | Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(Path(path).read_text(encoding="utf-8"))[
        "input_ids"
    ]


def score_all(setup: Setup, runs: list[Run], chunks: list[list[int]]) -> dict[str, Scored]:
    return {r.label: score(setup, r, chunks) for r in tqdm(runs, desc="runs")}
