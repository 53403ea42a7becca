"""`moe-offload eval` (teacher-forced perplexity per policy) and `moe-offload trace` (router
traces); `simulate` (replaying a trace) is cli/simulate.py."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.common import add_engine_flags, engine_config_from_args, resolve_model_dir
from cli.simulate import add_simulate_parser
from engine import MoeOffloadError, portable_path

if TYPE_CHECKING:
    from engine import EngineConfig


def _read_tokens(om, data: str, max_tokens: int, window: int = 0) -> list[int]:
    """Token ids of the data file. With max_tokens, take whole windows spread evenly over the
    file (not just its beginning), so every part of a multi-domain test split is represented."""
    path = Path(data)
    if not path.is_file():
        raise MoeOffloadError(f"{path}: data file not found; pass --data with a UTF-8 text file")
    if om.tokenizer is None:
        raise MoeOffloadError(f"{om.model_dir}: no tokenizer files; eval and trace need one")
    ids = om.tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"]
    if len(ids) < 2:
        raise MoeOffloadError(f"{path}: too little text (need at least 2 tokens)")
    if not max_tokens or max_tokens >= len(ids):
        return ids
    if window <= 0:
        return ids[:max_tokens]
    n = max(1, max_tokens // window)
    stride = (len(ids) - window) // max(n - 1, 1) if n > 1 else 0
    return [t for i in range(n) for t in ids[i * stride : i * stride + window]]


def cmd_eval(args: argparse.Namespace) -> int:
    from cli.policy_sweep import UNPROTECTED, pearson

    base = engine_config_from_args(args)
    if args.settle_background is None:  # eval is deterministic unless asked otherwise
        base = replace(base, settle_background=True)
    model_dir = resolve_model_dir(args.model)
    if not Path(args.data).is_file():
        raise MoeOffloadError(
            f"{args.data}: data file not found; pass --data with a UTF-8 text file"
        )
    runs = _eval_runs(args, base)
    results, prefetchers, ids = _evaluate(args, base, model_dir, runs)
    rows = _print_rows(results, prefetchers)
    print(
        "prefetch (--prefetch "
        + base.prefetch
        + "): "
        + ", ".join(f"{label} {pf}" for label, pf in prefetchers.items())
    )
    out = {
        "model": portable_path(model_dir),
        "data": portable_path(args.data),
        "tokens": len(ids or []),
        "window": args.window,
        "cache_fraction": base.cache_fraction,
        "prefetch": base.prefetch,
        "results": rows,
    }
    if len(rows) > 2:
        prot = [
            r for r in rows if r["label"] not in UNPROTECTED and not r["label"].endswith("(async)")
        ]
        out["mass_hypothesis_pearson_r"] = pearson(
            [r["mean_substituted_mass"] for r in prot], [r["delta_ppl_pct"] for r in prot]
        )
        print(
            f"mass hypothesis: Pearson r(substituted mass, ΔPPL) over first-choice-protecting policies = {out['mass_hypothesis_pearson_r']:.3f}"
        )
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(out, indent=2))
    if args.plot:
        _plot(rows, Path(args.plot), base.cache_fraction)
    return 0


def _eval_runs(args: argparse.Namespace, base: EngineConfig) -> dict[str, dict[str, Any]]:
    """The rows to evaluate, label -> EngineConfig overrides; fetch-all first (the reference)."""
    from cli.policy_sweep import POLICY_SWEEP

    if args.policies:
        unknown = [p for p in args.policies.split(",") if p not in POLICY_SWEEP]
        if unknown:
            raise MoeOffloadError(
                f"unknown --policies entry {unknown[0]!r}; choose from: {', '.join(POLICY_SWEEP)}"
            )
        runs = {
            "fetch-all": POLICY_SWEEP["fetch-all"],
            **{p: POLICY_SWEEP[p] for p in args.policies.split(",")},
        }
    elif args.all_policies:
        runs = dict(POLICY_SWEEP)
    else:
        runs = {"fetch-all": {"policy": "fetch-all"}, base.policy: {}}
    if args.async_rows:
        # The server's behaviour: background loads land whenever the link delivers them.
        runs.update(
            {
                f"{label} (async)": {**overrides, "settle_background": False}
                for label, overrides in list(runs.items())
                if label != "fetch-all"
            }
        )
    return runs


def _evaluate(
    args: argparse.Namespace, base: EngineConfig, model_dir: str, runs: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, str], list[int] | None]:
    """Load the model once per row and evaluate the same tokens: (results, prefetchers, ids)."""
    # After the checks in cmd_eval: these imports take seconds.
    from engine import load_model, teacher_forced_eval

    results = {}
    prefetchers: dict[str, str] = {}
    ids: list[int] | None = None
    for label, overrides in runs.items():
        om = load_model(model_dir, replace(base, **overrides))
        try:
            ids = ids or _read_tokens(om, args.data, args.max_tokens, args.window)
            results[label] = teacher_forced_eval(om, ids, args.window, label)
            # what --prefetch (auto) resolved to for this row
            prefetchers[label] = ",".join(om.prefetchers) or "none"
        finally:
            om.close()
    return results, prefetchers, ids


def _print_rows(results: dict[str, Any], prefetchers: dict[str, str]) -> list[dict[str, Any]]:
    """Print the table, ΔPPL against fetch-all; return its rows for --out-json."""
    ref = results["fetch-all"].ppl
    rows = []
    print(
        f"{'policy':28s} {'PPL':>9s} {'ΔPPL %':>8s} {'subst. calls':>12s} {'subst. mass':>11s} {'fetches/tok':>11s} {'admissions':>10s}"
    )
    for label, r in results.items():
        d = 100.0 * (r.ppl / ref - 1.0)
        rows.append(
            {"label": label, "delta_ppl_pct": d, "prefetch": prefetchers[label], **r.to_dict()}
        )
        print(
            f"{label:28s} {r.ppl:9.3f} {d:+8.2f} {r.substitution_rate:12.2%} {r.mean_substituted_mass:11.4f} {r.fetches_per_token:11.2f} {r.admissions:10d}"
        )
    return rows


def _plot(rows: list[dict], path: Path, fraction: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cli.policy_sweep import UNPROTECTED

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in rows:
        unprot = r["label"] in UNPROTECTED
        ax.scatter(
            r["mean_substituted_mass"],
            r["delta_ppl_pct"],
            marker="x" if unprot else "o",
            color="tab:red" if unprot else "tab:blue",
        )
        ax.annotate(
            r["label"],
            (r["mean_substituted_mass"], r["delta_ppl_pct"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.set_xlabel("mean substituted gate mass per token-layer")
    ax.set_ylabel("ΔPPL vs fetch-all (%)")
    ax.set_title(
        f"Quality cost of substitution (cache {'as planned' if fraction is None else f'{fraction:.0%}'}); x = first choice not protected",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def cmd_trace(args: argparse.Namespace) -> int:
    from engine import EngineConfig, load_model, record_trace, save_trace

    # With --expert-quant the trace records the quantized expert size, which `simulate` then charges per transfer.
    om = load_model(
        resolve_model_dir(args.model),
        EngineConfig(device=args.device or "auto", expert_quant=args.expert_quant),
    )
    try:
        ids = _read_tokens(om, args.data, args.max_tokens, args.window)
        path = save_trace(
            record_trace(om, ids, args.window, logits=args.logits, hidden=args.hidden), args.out
        )
    finally:
        om.close()
    print(f"wrote {path}: {len(ids)} tokens x {len(om.moe_layers)} MoE layers")
    return 0


def add_eval_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`eval`, `trace` and (cli/simulate.py) `simulate`."""
    _add_eval_parser(sub)
    _add_trace_parser(sub)
    add_simulate_parser(sub)


def _add_eval_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser(
        "eval",
        help="teacher-forced perplexity per miss policy",
        description="Teacher-forced perplexity on held-out text, decoding token by token so the expert cache evolves exactly as in generation. Reports PPL, ΔPPL %% against fetch-all on the same tokens, the share of expert calls substituted, the mean substituted gate mass per token-layer and fetches per token.",
    )
    e.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="UTF-8 text to score, e.g. models/embedded/data/test.txt",
    )
    e.add_argument(
        "--all-policies",
        action="store_true",
        help="run every policy and preset (see cli/policy_sweep.py), print one table, and check the mass hypothesis",
    )
    e.add_argument(
        "--policies",
        metavar="A,B,...",
        help="run fetch-all plus these entries of the sweep (labels as in --all-policies, e.g. threshold,quality-first)",
    )
    e.add_argument(
        "--max-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="score about N tokens: whole windows spread evenly over the file (default 2048; 0 = all)",
    )
    e.add_argument(
        "--window",
        type=int,
        default=256,
        metavar="W",
        help="context window: the KV cache restarts every W tokens (default 256)",
    )
    e.add_argument(
        "--async-rows",
        action="store_true",
        help="also run each substituting policy with background loads landing asynchronously, as the server runs them (rows marked '(async)'; those numbers vary from run to run)",
    )
    e.add_argument("--out-json", metavar="PATH", help="write all numbers as JSON here")
    e.add_argument(
        "--plot", metavar="PNG", help="write a scatter plot of ΔPPL against substituted mass here"
    )
    add_engine_flags(e)
    e.set_defaults(func=cmd_eval)


def _add_trace_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser(
        "trace",
        help="record router traces (top-k ids and weights per token and layer)",
        description="Record, for every token and MoE layer, the router's top-k expert ids and gate weights (optionally full logits and the router input hidden state) into a compressed .npz file; the format is documented in engine/offline/trace.py.",
    )
    t.add_argument(
        "--data", required=True, metavar="FILE", help="UTF-8 text to run through the model"
    )
    t.add_argument("--out", required=True, metavar="PATH", help="output .npz path")
    t.add_argument("--model", metavar="DIR", help="model directory (default: the embedded model)")
    t.add_argument(
        "--logits", action="store_true", help="also store full router logits [N, L, E] (float16)"
    )
    t.add_argument(
        "--hidden",
        action="store_true",
        help="also store router input hidden states [N, L, H] (float16)",
    )
    t.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        metavar="N",
        help="trace about N tokens: whole windows spread evenly over the file, as eval does (default 0 = all)",
    )
    t.add_argument(
        "--window", type=int, default=256, metavar="W", help="tokens per forward pass (default 256)"
    )
    t.add_argument("--device", metavar="DEV", help="compute device (default auto)")
    t.add_argument(
        "--expert-quant",
        choices=["none", "int8", "int4"],
        default="none",
        help="record the byte size of quantized experts (default none)",
    )
    t.set_defaults(func=cmd_trace)
