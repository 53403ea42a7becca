"""`moe-offload train-prefetcher`: train SpecPrefetch's router adapter for a model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cli.common import resolve_model_dir
from engine import MoeOffloadError, portable_path


def cmd_train_prefetcher(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from engine import (
        FILE_NAME,
        EngineConfig,
        data_from_trace,
        evaluate,
        evaluate_base,
        load_model,
        model_fingerprint,
        save_adapter,
        train_adapter,
    )

    torch.set_num_threads(args.threads)
    model_dir = Path(resolve_model_dir(args.model))
    data = Path(args.data)
    if not data.is_file():
        raise MoeOffloadError(
            f"{data}: data file not found; pass --data with a UTF-8 text file or a trace .npz"
        )
    om = load_model(model_dir, EngineConfig(device=args.device))
    try:
        if len(om.moe_layers) < 2:
            raise MoeOffloadError(
                f"{model_dir}: the prefetcher needs at least 2 MoE layers (it predicts layer l+1 from layer l)"
            )
        trace = _trace(om, data, args)
        try:
            examples = data_from_trace(trace, om.model, om.moe_layers)
        except ValueError as e:
            raise MoeOffloadError(f"{data}: {e}") from None
        fit, held = examples.split(1.0 - args.valid_frac)
        adapter = train_adapter(
            fit,
            args.rank,
            args.steps,
            lr=args.lr,
            bias=not args.no_bias,
            fate_base=not args.no_fate_base,
            seed=args.seed,
            valid=held,
        )
        fate = evaluate_base(held)
        ours = evaluate(adapter, held)
        share = adapter.trainable_parameters() / om.parameter_count()
        print(
            f"held-out recall@{om.top_k} per anchor layer: adapter {[round(v, 3) for v in ours]} (mean {np.mean(ours):.3f}), "
            f"FATE-like {[round(v, 3) for v in fate]} (mean {np.mean(fate):.3f})"
        )
        print(
            f"adapter: {adapter.trainable_parameters():,} parameters = {share:.3%} of the model's"
        )
        out = Path(args.out) if args.out else model_dir / FILE_NAME
        save_adapter(
            adapter,
            out,
            model_fingerprint(om.model),
            {
                "data": portable_path(data),
                "tokens": int(examples.x.shape[0]),
                "steps": args.steps,
                "seed": args.seed,
                "heldout_recall": float(np.mean(ours)),
                "heldout_recall_fate": float(np.mean(fate)),
            },
        )
        print(f"wrote {portable_path(out)}")
    finally:
        om.close()
    return 0


def _trace(om: Any, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The training examples' source: a trace .npz as given, or one recorded from a text file
    (with router logits and hidden states, which the adapter learns from)."""
    import numpy as np

    from cli.eval import _read_tokens
    from engine import record_trace

    if data.suffix == ".npz":
        return dict(np.load(data))
    return record_trace(
        om,
        _read_tokens(om, str(data), args.max_tokens, args.window),
        args.window,
        logits=True,
        hidden=True,
    )


def add_prefetch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train-prefetcher",
        help="train SpecPrefetch's router adapter (next-layer expert predictor) for a model",
        description="Train the low-rank adapter that predicts layer l+1's router logits from layer l's router input "
        "(engine/prefetch/adapter.py). Predictions only start transfers: `serve --prefetch adapter`.",
    )
    p.add_argument("--model", metavar="DIR", help="model directory (default: the embedded model)")
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="UTF-8 text (traced on the fly) or a trace .npz recorded with `moe-offload trace --hidden --logits`",
    )
    p.add_argument(
        "--out",
        metavar="PATH",
        help="output file (default: prefetcher.safetensors in the model directory, where serve finds it)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=60000,
        metavar="N",
        help="text only: trace about N tokens, whole windows spread over the file (default 60000; 0 = all)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=256,
        metavar="W",
        help="text only: tokens per traced forward pass (default 256)",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=64,
        metavar="R",
        help="rank r of the shared map B·A: r·(hidden + experts) parameters (default 64)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=1500,
        metavar="N",
        help="optimiser steps of 1024 examples (default 1500)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        metavar="LR",
        help="peak AdamW learning rate, cosine-decayed to 10%% (default 3e-3)",
    )
    p.add_argument(
        "--valid-frac",
        type=float,
        default=0.1,
        metavar="F",
        help="last share of the tokens held out for the recall report (default 0.1)",
    )
    p.add_argument("--no-bias", action="store_true", help="no per-layer bias b_l")
    p.add_argument(
        "--no-fate-base",
        action="store_true",
        help="the seed's plain B·A·x form, without the next router's own guess as a base",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for initialisation and batch sampling (default 0)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--device", default="auto", metavar="DEV", help="compute device for tracing (default auto)"
    )
    p.set_defaults(func=cmd_train_prefetcher)
