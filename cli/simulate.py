"""`moe-offload simulate`: replay a router trace (from `moe-offload trace`) under a policy and a
hardware profile; every figure it prints is simulated."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine import MoeOffloadError


def cmd_simulate(args: argparse.Namespace) -> int:
    from cli.policy_sweep import POLICY_SWEEP
    from engine import OraclePredictor

    trace, shape = _load_trace(args)
    costs = _costs(args, trace, shape)
    runs = dict(POLICY_SWEEP) if args.all_policies else {args.policy: {"policy": args.policy}}
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
    settings = _settings(args, predictor)
    rows, first = [], None
    for name, overrides in runs.items():
        res = _replay(args, trace, costs, settings, overrides)
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


def _load_trace(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The trace, projected onto --project-to's shape where given, and the shape's name."""
    from engine import load_trace, project_trace

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
    return trace, shape


def _costs(args: argparse.Namespace, trace: dict[str, Any], shape: str) -> Any:
    """The replay's costs: a hardware profile (its link overridden by --link), or the box described
    by --link, --layer-compute-us, --expert-compute-us and --workers."""
    from engine import ProfileError, costs_for, manual_costs, parse_link, with_link

    expert_bytes = args.expert_bytes or (
        None if args.project_to else trace["meta"].get("expert_nbytes")
    )
    try:
        if args.hardware:
            costs = costs_for(args.hardware, shape, expert_bytes)
            if args.link:
                link = parse_link(args.link)
                costs = with_link(costs, link.mb_per_s, link.latency_us)
            return costs
        if args.project_to:
            raise MoeOffloadError(
                "--project-to needs --hardware: a projected shape's expert size and compute come from the profile"
            )
        link = parse_link(args.link or "nvme")
        return manual_costs(
            link.mb_per_s,
            link.latency_us,
            int(expert_bytes or 0),
            args.layer_compute_us * 1e-6,
            args.expert_compute_us * 1e-6,
            args.workers,
        )
    except ProfileError as e:
        raise MoeOffloadError(str(e)) from None


def _settings(args: argparse.Namespace, predictor: Any) -> Any:
    from engine import Acceptance, SimSettings

    acceptance = (
        Acceptance(tuple(float(x) for x in args.acceptance.split(",")))
        if args.acceptance
        else Acceptance()
    )
    return SimSettings(
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


def _replay(
    args: argparse.Namespace, trace: dict[str, Any], costs: Any, settings: Any, overrides: dict
) -> dict[str, Any]:
    """One policy's replay, with --substitute and --eviction applied over its settings."""
    from engine import EngineConfig, Simulator

    overrides = dict(overrides)
    if args.substitute:
        overrides["substitute"] = args.substitute
    if args.project_to and overrides.get("policy", "fetch-all") != "fetch-all":
        overrides["substitute"] = (
            "drop"  # a projected trace has no logits (engine/offline/projection.py)
        )
    if args.eviction:
        overrides["eviction"] = args.eviction
    try:
        return (
            Simulator(trace, EngineConfig(**overrides).policies(), costs, settings).run().to_dict()
        )
    except ValueError as e:
        raise MoeOffloadError(str(e)) from None


def add_simulate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    m = sub.add_parser(
        "simulate",
        help="replay a router trace under a policy and a hardware profile (simulated figures)",
        description="Replay a trace from `moe-offload trace` through the same policy objects the engine uses (miss, eviction, admission, the speculative utility estimator, adaptive k, the CPU/GPU balancer) against a model of the fast tier, the link, the compute device and CPU workers, with costs from a hardware profile (configs/hardware/*.yaml), and estimate tokens/s, stall share, hits, loads and prefetch precision. All figures are simulated; with --project-to they are also projections onto a real model's shape (engine/offline/projection.py states the assumptions). The exact routing is replayed even for substituting policies.",
    )
    _add_trace_and_policy_flags(m)
    _add_replay_flags(m)
    _add_cost_and_output_flags(m)
    m.set_defaults(func=cmd_simulate)


def _add_trace_and_policy_flags(m: argparse.ArgumentParser) -> None:
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


def _add_replay_flags(m: argparse.ArgumentParser) -> None:
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


def _add_cost_and_output_flags(m: argparse.ArgumentParser) -> None:
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
