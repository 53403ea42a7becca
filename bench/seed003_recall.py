"""Seed 003's recall table: every next-layer predictor the paper compares, fitted on one text of
the embedded pair and scored on another (held out), with its parameter count. The ranked
predictions on the held-out tokens go on to the simulator (bench/seed003_speed.py).

Predictors (engine/prefetch/predictors.py):
- SpecPrefetch, shipped form: the model's prefetcher.safetensors (next router's guess + shared
  rank-64 map + per-layer bias), as `--prefetch adapter` serves it;
- SpecPrefetch, the paper's plain form B·A·x_l (no router guess, no bias), trained here;
- FATE: the next router on this layer's input;
- ProMoE-style: a per-layer MLP from x_l, no router guess, trained here;
- draft model: per-layer linear heads on the draft's last hidden state, trained here.
All trained ones use the shipped adapter's loss and recipe (training.py fit_predictor).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import (
    FILE_NAME,
    AdapterData,
    PerLayerPredictor,
    data_from_trace,
    draft_hidden_states,
    evaluate,
    fate_predictor,
    fit_predictor,
    load_adapter,
    model_fingerprint,
    predict,
    train_adapter,
)

SHIPPED = "SpecPrefetch (shipped: guess + B·A·x + bias)"
PLAIN = "SpecPrefetch (paper's form: B·A·x)"
FATE = "FATE (next router on x_l)"
PROMOE = "ProMoE-style (per-layer MLP on x_l)"
DRAFT = "draft model (heads on the draft's hidden state)"


@dataclass
class RecallSetup:
    model_dir: Path
    draft_dir: Path
    train_data: str
    test_data: str
    train_tokens: int
    test_tokens: int
    steps: int
    rank: int
    promoe_width: int
    window: int = 256
    only: tuple[str, ...] = ()  # the predictors to fit and score (empty: every one)


def traced(om: Any, path: str, tokens: int, window: int) -> tuple[dict, AdapterData, list]:
    """Router trace (hidden states, logits) of `tokens` tokens of `path`, windows of `window`."""
    from cli.eval import _read_tokens
    from engine import record_trace

    ids = _read_tokens(om, path, tokens, window)
    trace = record_trace(om, ids, window, logits=True, hidden=True)
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    return trace, data_from_trace(trace, om.model, om.moe_layers), windows


def with_inputs(data: AdapterData, x: torch.Tensor) -> AdapterData:
    """The same examples with another input per token (x [N, D']): the draft's hidden state,
    the same for every anchor layer (a view, no copy)."""
    xs = x.unsqueeze(1).expand(-1, data.anchors, -1)
    return AdapterData(xs, data.base, data.teacher, data.true_ids, data.score_bias)


def load_draft(draft_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()


def ranked_ids(module: torch.nn.Module, data: AdapterData, k: int) -> np.ndarray:
    """[N, A, k]: each token's k predicted experts per anchor, most likely first (the router's
    own ranking of the predicted logits)."""
    return np.stack(
        [
            data.ranked(predict(module, data, a), a).topk(k, dim=-1).indices.numpy()
            for a in range(data.anchors)
        ],
        axis=1,
    )


def fit_all(s: RecallSetup, fit: AdapterData, draft_fit: AdapterData, shipped: Any) -> dict:
    """name -> (module, parameters, which inputs it reads: 'target' or 'draft'), for the
    predictors `s.only` names (all when empty). They are trained in one order from one seed, so a
    subset's modules differ from the full run's."""
    torch.manual_seed(0)
    N, A, D = fit.x.shape
    E = fit.teacher.shape[-1]
    out: dict[str, tuple[torch.nn.Module, int, str]] = {}
    want = set(s.only or (SHIPPED, PLAIN, FATE, PROMOE, DRAFT))
    if SHIPPED in want:
        out[SHIPPED] = (shipped, shipped.trainable_parameters(), "target")
    if PLAIN in want:
        plain = train_adapter(fit, s.rank, s.steps, bias=False, fate_base=False)
        out[PLAIN] = (plain, plain.trainable_parameters(), "target")
    if PROMOE in want:
        promoe = fit_predictor(
            PerLayerPredictor(D, E, A, s.promoe_width, fate_base=False),
            fit,
            s.steps,
            desc="ProMoE-style",
        )
        out[PROMOE] = (promoe, promoe.trainable_parameters(), "target")
    if DRAFT in want:
        draft = fit_predictor(
            PerLayerPredictor(draft_fit.x.shape[-1], E, A, 0, fate_base=False),
            draft_fit,
            s.steps,
            desc="draft heads",
        )
        out[DRAFT] = (draft, draft.trainable_parameters(), "draft")
    if FATE in want:  # built after the training: its initialisation draws from the same seed
        out[FATE] = (fate_predictor(D, E, A), 0, "target")
    return {n: out[n] for n in (SHIPPED, PLAIN, FATE, PROMOE, DRAFT) if n in out}


def recall_run(s: RecallSetup) -> dict[str, Any]:
    """Fit, score, and keep every predictor's ranked held-out predictions for the simulator."""
    from engine import EngineConfig, load_model

    om = load_model(s.model_dir, EngineConfig())
    try:
        _, fit, fit_windows = traced(om, s.train_data, s.train_tokens, s.window)
        held_trace, held, held_windows = traced(om, s.test_data, s.test_tokens, s.window)
        shipped = load_adapter(s.model_dir / FILE_NAME, model_fingerprint(om.model))
        model_params, k = om.parameter_count(), om.top_k
    finally:
        om.close()
    draft_model = load_draft(s.draft_dir)
    draft_params = sum(p.numel() for p in draft_model.parameters())
    draft_fit = with_inputs(fit, draft_hidden_states(draft_model, fit_windows))
    draft_held = with_inputs(held, draft_hidden_states(draft_model, held_windows))
    del draft_model
    predictors = fit_all(s, fit, draft_fit, shipped)
    rows, ranked, modules = [], {}, {}
    for name, (module, params, inputs) in predictors.items():
        data = draft_held if inputs == "draft" else held
        rec = evaluate(module, data)
        # The draft predictor needs the whole draft model running too: its cost counts.
        total = params + (draft_params if inputs == "draft" else 0)
        rows.append(
            {
                "predictor": name,
                "recall_per_layer": rec,
                "recall": float(np.mean(rec)),
                "parameters": params,
                "parameters_with_draft": total,
            }
        )
        ranked[name] = ranked_ids(module, data, k)
        modules[name] = module
    return {
        "rows": rows,
        "ranked": ranked,
        "modules": modules,
        "held_trace": held_trace,
        "model_parameters": model_params,
        "draft_parameters": draft_params,
        "fit_tokens": int(fit.x.shape[0]),
        "held_tokens": int(held.x.shape[0]),
        "top_k": k,
    }
