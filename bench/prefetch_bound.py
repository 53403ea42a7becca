"""How predictable is layer l+1's routing from layer l's router input at all? Bounds for the adapter.

SpecPrefetch's adapter (engine/prefetch/adapter.py) is the next router's own guess plus one
shared low-rank map and a per-layer bias: a linear function of x_l. This script fits richer
predictors on the same examples, with the same loss and recipe (engine/prefetch/training.py
fit_predictor), and reports their held-out recall@k beside the adapter's:

- **per-layer linear**: the next router's guess plus a full D×E matrix and bias per anchor layer.
  Every linear predictor of the next logits from x_l is of this form, so its recall bounds the
  adapter's (whatever its rank, and with or without sharing across layers) up to training noise.
- **per-layer MLP**: the guess plus a one-hidden-layer GELU network per anchor layer (much larger
  than the 2 % budget): a rough ceiling for nonlinear predictors of this size from x_l alone.

Train on one text, report on another (held out), as `moe-offload train-prefetcher` does.

    python -m bench.prefetch_bound --out docs/benchmarks/prefetch_bound.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.report import add_common_flags, machine_line, write_report
from cli.common import resolve_model_dir
from cli.eval import _read_tokens
from engine import (
    AdapterData,
    EngineConfig,
    PerLayerPredictor,
    data_from_trace,
    evaluate,
    evaluate_base,
    fit_predictor,
    load_model,
    portable_path,
    record_trace,
    train_adapter,
)


def examples(om, path: str, tokens: int) -> AdapterData:
    trace = record_trace(om, _read_tokens(om, path, tokens, 256), 256, logits=True, hidden=True)
    return data_from_trace(trace, om.model, om.moe_layers)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument(
        "--train-data",
        default="models/embedded/data/valid.txt",
        help="text the predictors are fitted on (default: the validation split, as the shipped adapter)",
    )
    ap.add_argument(
        "--test-data",
        default="models/embedded/data/test.txt",
        help="held-out text recall is measured on (default: the test split)",
    )
    ap.add_argument(
        "--train-tokens",
        type=int,
        default=60000,
        help="tokens traced for fitting (default 60000, train-prefetcher's default)",
    )
    ap.add_argument(
        "--test-tokens",
        type=int,
        default=20000,
        help="held-out tokens (default 20000, as bench/prefetch_bench.py)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=1500,
        help="optimiser steps of 1024 examples for every predictor (default 1500)",
    )
    ap.add_argument(
        "--mlp-width", type=int, default=512, help="hidden width of the per-layer MLP (default 512)"
    )
    add_common_flags(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model)
    om = load_model(Path(model_dir), EngineConfig())
    try:
        fit, held = (
            examples(om, args.train_data, args.train_tokens),
            examples(om, args.test_data, args.test_tokens),
        )
        params = om.parameter_count()
    finally:
        om.close()
    N, A, D = fit.x.shape
    E = fit.teacher.shape[-1]
    torch.manual_seed(0)
    predictors: dict[str, nn.Module] = {
        "adapter (shipped form: rank 64, shared, per-layer bias)": train_adapter(
            fit, 64, args.steps
        ),
        "per-layer linear (bound for any linear predictor)": fit_predictor(
            PerLayerPredictor(D, E, A), fit, args.steps, desc="per-layer linear"
        ),
        f"per-layer MLP, width {args.mlp_width}": fit_predictor(
            PerLayerPredictor(D, E, A, args.mlp_width), fit, args.steps, desc="per-layer MLP"
        ),
    }
    rows = {"FATE-like (next router on x_l)": (evaluate_base(held), 0)}
    for name, m in predictors.items():
        rows[name] = (evaluate(m, held), sum(p.numel() for p in m.parameters()))
    k = int(held.true_ids.shape[-1])
    lines = [
        "| predictor | "
        + " | ".join(f"recall@{k} layer {a + 1}" for a in range(A))
        + " | mean | parameters | share of the model |",
        "|---" * (A + 4) + "|",
    ]
    for name, (rec, n) in rows.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{r:.1%}" for r in rec)
            + f" | **{np.mean(rec):.1%}** | {n:,} | {n / params:.2%} |"
        )
    header = (
        f"{machine_line(args.threads)} Model: "
        f"{portable_path(Path(model_dir))} ({params:,} parameters). Fitted on {N:,} tokens of {args.train_data}, recall on "
        f"{held.x.shape[0]:,} tokens of {args.test_data}; {args.steps} steps of 1024 examples each."
    )
    write_report(
        args.out,
        header,
        lines,
        {name: {"recall": rec, "parameters": n} for name, (rec, n) in rows.items()},
    )


if __name__ == "__main__":
    main()
