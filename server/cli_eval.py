"""`moe-offload eval` (teacher-forced perplexity per policy) and `moe-offload trace` (router traces)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from engine.errors import MoeOffloadError
from engine.paths import portable_path
from server.cli_common import add_engine_flags, engine_config_from_args, resolve_model_dir


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
    from engine.offline.evaluation import teacher_forced_eval
    from engine.worker.loader import load_model
    from server.policy_sweep import POLICY_SWEEP, UNPROTECTED, pearson

    base = engine_config_from_args(args)
    if args.settle_background is None:  # eval is deterministic unless asked otherwise
        base = replace(base, settle_background=True)
    model_dir = resolve_model_dir(args.model)
    if not Path(args.data).is_file():
        raise MoeOffloadError(
            f"{args.data}: data file not found; pass --data with a UTF-8 text file"
        )
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
    results = {}
    prefetchers: dict[str, str] = {}
    ids: list[int] | None = None
    for label, overrides in runs.items():
        om = load_model(model_dir, replace(base, **overrides))
        try:
            ids = ids or _read_tokens(om, args.data, args.max_tokens, args.window)
            results[label] = teacher_forced_eval(om, ids, args.window, label)
            prefetchers[label] = (
                ",".join(om.prefetchers) or "none"
            )  # what --prefetch (auto) resolved to for this row
        finally:
            om.close()
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


def _plot(rows: list[dict], path: Path, fraction: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from server.policy_sweep import UNPROTECTED

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
    from engine.config import EngineConfig
    from engine.offline.trace import record_trace, save_trace
    from engine.worker.loader import load_model

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


def cmd_simulate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.experts.link import parse_link
    from engine.offline.hardware import ProfileError, costs_for, with_link
    from engine.offline.projection import project_trace
    from engine.offline.simulator import (
        Acceptance,
        OraclePredictor,
        SimSettings,
        Simulator,
        load_trace,
        manual_costs,
    )
    from server.policy_sweep import POLICY_SWEEP

    if not Path(args.trace).is_file():
        raise MoeOffloadError(
            f"{args.trace}: trace file not found; record one with `moe-offload trace`"
        )
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError, KeyError) as e:
        raise MoeOffloadError(
            f"{args.trace}: not a trace written by `moe-offload trace` ({e})"
        ) from None
    shape = args.project_to or "embedded"
    if args.project_to:
        try:
            trace = project_trace(trace, args.project_to, seed=args.seed)
        except ValueError as e:
            raise MoeOffloadError(str(e)) from None
    expert_bytes = args.expert_bytes or (
        None if args.project_to else trace["meta"].get("expert_nbytes")
    )
    try:
        if args.hardware:
            costs = costs_for(args.hardware, shape, expert_bytes)
            if args.link:
                link = parse_link(args.link)
                costs = with_link(costs, link.mb_per_s, link.latency_us)
        else:
            if args.project_to:
                raise MoeOffloadError(
                    "--project-to needs --hardware: a projected shape's expert size and compute come from the profile"
                )
            link = parse_link(args.link or "nvme")
            costs = manual_costs(
                link.mb_per_s,
                link.latency_us,
                int(expert_bytes or 0),
                args.layer_compute_us * 1e-6,
                args.expert_compute_us * 1e-6,
                args.workers,
            )
    except ProfileError as e:
        raise MoeOffloadError(str(e)) from None
    runs = dict(POLICY_SWEEP) if args.all_policies else {args.policy: {"policy": args.policy}}
    acceptance = (
        Acceptance(tuple(float(x) for x in args.acceptance.split(",")))
        if args.acceptance
        else Acceptance()
    )
    predictor = None
    if args.predictor.startswith("oracle"):
        recall = float(args.predictor.split(":", 1)[1]) if ":" in args.predictor else 1.0
        predictor = OraclePredictor(trace, recall, seed=args.seed)
    label = "PROJECTED + SIMULATED" if args.project_to else "SIMULATED"
    print(
        f"{label}: profile {costs.profile}, shape {shape}, link {costs.link_mb_per_s:g} MB/s + {costs.link_latency_s * 1e6:g} us, "
        f"{costs.expert_bytes} B/expert, cache {args.cache_fraction}, {args.streams} stream(s), speculative {args.speculative}, "
        f"prefetch {args.prefetch}{' + predictor ' + args.predictor if predictor else ''}, cpu-experts {args.cpu_experts}, {trace['ids'].shape[0]} trace tokens"
    )
    print(
        f"{'policy':28s} {'tok/s':>8s} {'x first':>7s} {'stall':>6s} {'hit':>5s} {'loads/tok':>9s} {'subst/tok':>9s} {'mass':>7s} {'tok/verif':>9s} {'pf prec':>7s} {'pf rec':>6s} {'cpu/tok':>7s} {'tok-layers/s':>12s}"
    )
    rows, first = [], None
    for name, overrides in runs.items():
        overrides = dict(overrides)
        if args.substitute:
            overrides["substitute"] = args.substitute
        if args.project_to and overrides.get("policy", "fetch-all") != "fetch-all":
            overrides["substitute"] = (
                "drop"  # a projected trace has no logits (engine/offline/projection.py)
            )
        if args.eviction:
            overrides["eviction"] = args.eviction
        settings = SimSettings(
            cache_fraction=args.cache_fraction,
            streams=args.streams,
            speculative=args.speculative == "draft",
            k=args.num_speculative_tokens,
            adaptive=not args.fixed_k,
            acceptance=acceptance,
            prefetch=args.prefetch,
            cpu_experts=args.cpu_experts,
            max_tokens=args.max_tokens or None,
            seed=args.seed,
            predictor=predictor,
            predictor_budget=args.predictor_budget,
        )
        try:
            res = (
                Simulator(trace, EngineConfig(**overrides).policies(), costs, settings)
                .run()
                .to_dict()
            )
        except ValueError as e:
            raise MoeOffloadError(str(e)) from None
        first = first or res["tokens_per_s"]
        rows.append({"label": name, **res, "x_first": res["tokens_per_s"] / first})
        print(
            f"{name:28s} {res['tokens_per_s']:8.1f} {res['tokens_per_s'] / first:6.2f}x {res['stall_share']:6.0%} {res['hit_share']:5.0%} "
            f"{res['loads_per_token']:9.2f} {res['substituted_per_token']:9.2f} {res['mean_substituted_mass']:7.4f} {res['tokens_per_verification']:9.2f} "
            f"{res['prefetch_precision']:7.0%} {res['prefetch_recall']:6.0%} {res['cpu_expert_calls'] / max(res['tokens'], 1):7.2f} {res['token_layers_per_s']:12.0f}"
        )
    if args.out_json:
        Path(args.out_json).write_text(
            json.dumps(
                {
                    "simulated": True,
                    "projected": bool(args.project_to),
                    "profile": costs.profile,
                    "shape": shape,
                    "costs": {k: v for k, v in vars(costs).items()},
                    "rows": rows,
                },
                indent=2,
                default=str,
            )
        )
    return 0


def add_eval_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        help="run every policy and preset (see server/policy_sweep.py), print one table, and check the mass hypothesis",
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

    m = sub.add_parser(
        "simulate",
        help="replay a router trace under a policy and a hardware profile (simulated figures)",
        description="Replay a trace from `moe-offload trace` through the same policy objects the engine uses (miss, eviction, admission, the speculative utility estimator, adaptive k, the CPU/GPU balancer) against a model of the fast tier, the link, the compute device and CPU workers, with costs from a hardware profile (configs/hardware/*.yaml), and estimate tokens/s, stall share, hits, loads and prefetch precision. All figures are simulated; with --project-to they are also projections onto a real model's shape (engine/offline/projection.py states the assumptions). The exact routing is replayed even for substituting policies.",
    )
    m.add_argument(
        "--trace",
        required=True,
        metavar="NPZ",
        help="trace file written by `moe-offload trace` (use --logits there for best-resident substitution and for --project-to a top-10 shape)",
    )
    m.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="hardware profile: a name from configs/hardware (rtx3090-pcie4, rtx4090-pcie4, h200-pcie5, phone-ufs31, this-machine-disk, this-machine-disk-hdd) or a .yaml path. Without it, --link, --layer-compute-us and --expert-compute-us describe the box",
    )
    m.add_argument(
        "--project-to",
        metavar="SHAPE",
        choices=("qwen3-30b-a3b", "qwen3-next-80b-a3b"),
        help="rescale the trace onto a real model's routing shape (qwen3-30b-a3b or qwen3-next-80b-a3b); results are projections",
    )
    m.add_argument(
        "--policy",
        default="fetch-all",
        metavar="NAME",
        help="policy or preset to replay (default fetch-all)",
    )
    m.add_argument(
        "--all-policies",
        action="store_true",
        help="replay every policy of the eval sweep; the 'x first' column is against the first row, fetch-all",
    )
    m.add_argument(
        "--substitute",
        metavar="NAME",
        help="override the stand-in choice (best-resident or drop; projections always use drop)",
    )
    m.add_argument(
        "--eviction",
        metavar="NAME",
        help="override the eviction policy (lru, frequency, utility, reuse)",
    )
    m.add_argument(
        "--cache-fraction",
        type=float,
        default=0.25,
        metavar="F",
        help="fast-tier share of all routed experts (default 0.25)",
    )
    m.add_argument(
        "--streams",
        type=int,
        default=1,
        metavar="N",
        help="concurrent requests, each replaying its own stretch of the trace; their rows share each step (default 1)",
    )
    m.add_argument(
        "--speculative",
        choices=("off", "draft"),
        default="off",
        help="draft: verification windows of k+1 rows, the draft's cost charged per proposed token (default off)",
    )
    m.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        metavar="K",
        help="proposals per window, the most with adaptive k (default 4)",
    )
    m.add_argument(
        "--fixed-k",
        action="store_true",
        help="always propose K tokens (default: the engine's adaptive-k policy, k <= K)",
    )
    m.add_argument(
        "--acceptance",
        metavar="P1,P2,...",
        help="share of windows whose accepted run reaches position 1, 2, ... (default 0.38,0.33,0.13,0.07: measured, docs/benchmarks/speculative.md)",
    )
    m.add_argument(
        "--prefetch",
        choices=("none", "utility"),
        default="none",
        help="utility: MoE-SpAc prefetch from the speculative utility estimator (default none)",
    )
    m.add_argument(
        "--cpu-experts",
        choices=("off", "auto", "all"),
        default="off",
        help="auto: the balancer sends missed experts past its cut to CPU workers; all: every miss (default off)",
    )
    m.add_argument(
        "--predictor",
        default="none",
        metavar="none|oracle[:RECALL]",
        help="next-layer predictor hook: oracle prefetches the trace's true next-layer experts (with RECALL < 1, a share replaced by wrong ones). Default none",
    )
    m.add_argument(
        "--predictor-budget",
        type=int,
        metavar="N",
        help="predictor prefetches per layer and step (default: the model's top-k)",
    )
    m.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        metavar="N",
        help="stop after N generated tokens over all streams (default 0 = the whole trace)",
    )
    m.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the acceptance draws and the projection (default 0)",
    )
    m.add_argument(
        "--link",
        metavar="NAME|MBPS[:US]",
        help="the link that loads experts: overrides the profile's, or describes the box without --hardware (default nvme)",
    )
    m.add_argument(
        "--expert-bytes",
        type=int,
        metavar="N",
        help="bytes per expert on the link (default: the trace's, or the profile's for a projected shape)",
    )
    m.add_argument(
        "--layer-compute-us",
        type=float,
        default=700.0,
        metavar="US",
        help="without --hardware: dense compute per layer and step, µs (default 700)",
    )
    m.add_argument(
        "--expert-compute-us",
        type=float,
        default=150.0,
        metavar="US",
        help="without --hardware: compute per routed expert, µs (default 150)",
    )
    m.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="without --hardware: transfers in flight at once, as the engine's --transfer-workers (default 2)",
    )
    m.add_argument("--out-json", metavar="PATH", help="write the numbers as JSON")
    m.set_defaults(func=cmd_simulate)
