"""`moe-offload plan`: the placement `serve` would choose for a checkpoint on this machine (or on
the budgets given), and the decode speed the router-trace simulator projects for it per policy
preset, from config.json and the safetensors headers: no weight is loaded. The projection's costs are
this CPU's, measured (`--hardware measured`, engine/offline/machine_costs.py: the native kernels'
speed and a short timing of expert reads from the disk), or a hardware profile's."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine import ConfigError, CoreLimits, EngineConfig, add_flags, fmt_bytes, overrides_from_args

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine import Costs, Footprint, KvRequest, LoadPlan, MemoryPlan, ModelShape, Probe

PRESETS = ("fetch-all", "quality-first", "speed-first")  # exact, then the seed's two presets
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "embedded_test_trace.npz"
)
DEFAULT_PROFILE = (
    "measured"  # this CPU's kernels and disk, measured (engine/offline/machine_costs.py)
)
SIM_TOKENS = 128  # trace tokens replayed per preset: a stable mean in a few seconds even at 48 layers (every preset replays the same tokens)


def _shape(fp: Footprint, model_type: str):
    """The simulator's ModelShape for this checkpoint: a named one (with the profile's measured
    costs) when the routing shape matches, else one derived from the footprint."""
    from engine import SHAPES, ModelShape

    for s in SHAPES.values():
        if (s.experts, s.top_k, s.hidden) == (fp.experts_per_layer, fp.top_k, fp.hidden):
            # The same layer shape at another depth (a checkpoint cut to fewer layers): the named
            # shape's per-layer costs, its layer count replaced (see depth_scaled for the LM head).
            return s if s.layers == fp.moe_layers else replace(s, layers=fp.moe_layers)
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(fp.dtype, 2)
    head = fp.vocab * fp.hidden
    dense_params = max(0.0, fp.dense_bytes / itemsize - 2 * head) / max(1, fp.moe_layers)
    return ModelShape(
        model_type,
        layers=fp.moe_layers,
        experts=fp.experts_per_layer,
        top_k=fp.top_k,
        hidden=fp.hidden,
        moe_intermediate=fp.intermediate // max(1, fp.top_k),
        dense_params_per_layer=dense_params,
        head_params=head,
        source="derived from the checkpoint's config.json and safetensors headers",
    )


def depth_scaled(costs: Costs, shape: ModelShape) -> Costs:
    """`costs` for `shape` when it is a named shape at another depth: a profile's measured dense cost
    per layer spreads the LM head over the released depth (dense + head / released layers), so at
    `shape.layers` layers it is scaled by (dense + head / layers) / (dense + head / released)."""
    from engine import SHAPES

    named = SHAPES.get(shape.name)
    if named is None or named.layers == shape.layers or not shape.dense_params_per_layer:
        return costs
    per = lambda layers: shape.dense_params_per_layer + shape.head_params / layers  # noqa: E731
    f = per(shape.layers) / per(named.layers)
    a, b = costs.dense
    points = (
        tuple((rows, us * f) for rows, us in costs.dense_points)
        if costs.dense_points is not None
        else None
    )
    return replace(
        costs,
        dense=(a * f, b * f),
        dense_points=points,
        notes=(*costs.notes, f"dense scaled x{f:.2f} to {shape.layers} of {named.layers} layers"),
    )


def _head(trace: dict, n: int) -> dict:
    """The trace's first `n` tokens: all one stream of `n` tokens replays. Projecting only them
    gives the same routing (it is per token; the child draws come in token order) at a fraction
    of the cost of projecting every traced token onto 48 layers."""
    return {
        k: v[:n] if k in ("tokens", "ids", "weights", "logits") and v is not None else v
        for k, v in trace.items()
    }


def measured_costs(probe: Probe, cfg: EngineConfig) -> Costs:
    """The costs of `--hardware measured`: this CPU's kernels for the model's dtype and expert format
    (the dispatcher's measurement, cached per CPU) and the disk's O_DIRECT rate at expert-sized reads."""
    from engine import ProfileError, core_share, kernel_speeds, machine_costs, read_gb_s

    fp = probe.footprint
    if probe.device.type != "cpu":
        raise ProfileError(
            "--hardware measured times this CPU's kernels; for a CUDA device name a profile (h200-pcie5, rtx4090-pcie4, ...)"
        )
    speeds = kernel_speeds(
        probe.config,
        fp.dtype,
        cfg.expert_quant,
        fp.hidden,
        probe.moe_intermediate,
        fp.top_k,
        probe.expert_format,
    )
    if speeds is None:
        raise ProfileError(
            f"--hardware measured: no native kernel measurement for {fp.dtype} "
            f"with {probe.expert_format} experts here; name a profile (--hardware this-machine-disk)"
        )
    gb_s, reads = read_gb_s(probe.expert_reads)
    return machine_costs(
        speeds,
        gb_s,
        reads,
        probe.dense_streamed_bytes,
        fp.moe_layers,
        fp.slot_bytes,
        # what one disk-tier read moves: the quantized sidecar's row where it exists
        probe.expert_reads[0].nbytes if probe.expert_reads else fp.expert_disk_bytes,
        cfg.transfer_workers,
        cfg.cpu_workers,
        core_share(),
    )


def project(
    fp: Footprint,
    model_type: str,
    cache_fraction: float,
    hardware: str,
    link: str | None,
    trace_path: Path,
    measured: Callable[[], Costs] | None = None,
) -> tuple[list[tuple[str, float]], str]:
    """[(preset, projected decode tok/s)] and a one-line description of the projection (or why there
    is none). `measured`: the costs of `--hardware measured` (called only for it)."""
    from engine import (
        ProfileError,
        costs_for,
        load_trace,
        parse_link,
        project_trace,
        simulate,
        with_link,
    )

    shape = _shape(fp, model_type)
    try:
        trace = project_trace(_head(load_trace(trace_path), SIM_TOKENS), shape)
        if hardware == "measured":
            if measured is None:
                raise ProfileError("--hardware measured needs the checkpoint's probe")
            costs = replace(measured(), shape=shape.name)
        else:
            costs = depth_scaled(
                costs_for(hardware, shape, expert_bytes=fp.expert_disk_bytes), shape
            )
    except (OSError, ValueError, KeyError) as e:  # ProfileError is a ValueError
        return [], f"no projection: {e}"
    if link:
        spec = parse_link(link)
        costs = with_link(costs, spec.mb_per_s, spec.latency_us)
    rows = []
    for preset in PRESETS:
        cfg = (
            EngineConfig(policy=preset)
            if preset == "fetch-all"
            else EngineConfig(policy=preset, substitute="drop")
        )  # projected traces have no logits
        try:
            res = simulate(
                trace, cfg.policies(), cache_fraction, costs, max_tokens=SIM_TOKENS
            ).to_dict()
        except (ValueError, ProfileError) as e:
            return [], f"no projection: {e}"
        rows.append((preset, float(res["tokens_per_s"])))
    how = (
        f"PROJECTED (simulated): profile {costs.profile} ({', '.join(costs.notes)} costs), shape {shape.name}, link "
        f"{costs.link_mb_per_s:g} MB/s + {costs.link_latency_s * 1e6:g} us, {costs.expert_bytes} B/expert read, cache {cache_fraction:.0%}, "
        f"{min(SIM_TOKENS, trace['ids'].shape[0])} tokens of "
        + (
            "the embedded model's routing projected onto this shape (another model's routing: this one may "
            "reuse experts more or less; `moe-offload trace` records its own, for `--trace`)"
            if Path(trace_path) == Path(DEFAULT_TRACE)
            else f"the routing in {Path(trace_path).name}, projected onto this shape"
        )
    )
    return rows, how


def _kv_pool_line(
    fp: Footprint, cfg: EngineConfig, kv: KvRequest, max_model_len: int | None, plan: MemoryPlan
) -> str:
    """What `serve` makes of the kv_cache row on the CPU: the paged pool's blocks (engine/core/kv_blocks.py)."""
    from engine import BLOCK_TOKENS, kv_token_budget, pool_blocks

    context = min(max_model_len or fp.context, fp.context)
    blocks = pool_blocks(kv_token_budget(fp, cfg, kv), context)
    return (
        f"  KV pool (CPU, native attention): {blocks} blocks of {BLOCK_TOKENS} positions, "
        f"{fmt_bytes(blocks * BLOCK_TOKENS * fp.kv_bytes_per_token)}: the kv_cache row's positions, at least one "
        f"{context}-token context; requests share whole prefix blocks, pages are touched as blocks are used\n"
        + _split_line(fp, cfg, plan, blocks * BLOCK_TOKENS * fp.kv_bytes_per_token)
    )


def _split_line(fp: Footprint, cfg: EngineConfig, plan: MemoryPlan, kv_bytes: int) -> str:
    """The KV/expert split `serve` starts with beside that pool, and how far it may move (engine/memory/split.py)."""
    from engine import BLOCK_TOKENS, fixed_why, split_line
    from policies.memory_split import movable_slots

    n, floor = plan.n_slots, min(fp.top_k, plan.n_slots)
    movable = movable_slots(n, floor, cfg.kv_borrow_share)
    block_bytes = BLOCK_TOKENS * fp.kv_bytes_per_token
    why = fixed_why(plan)
    return "  " + split_line(
        kv_bytes, n, plan.slot_bytes, movable, block_bytes, cfg.kv_borrow_share, why
    )


def plan_ahead(model: str | Path, cfg: EngineConfig, kv: KvRequest) -> tuple[Probe, LoadPlan]:
    """The load plan `serve` would make for `model` on this machine (engine/plan/; ConfigError where it
    cannot run or fit), and the checkpoint's probe for the projection: one survey for both."""
    from engine import decide, machine_ahead, probe_of, survey

    machine = machine_ahead(cfg)
    sv = survey(model, cfg, machine.device)
    return probe_of(sv, cfg), decide(sv, cfg, machine, kv)


def cmd_plan(args: argparse.Namespace) -> int:
    from engine import KvRequest

    t0 = time.perf_counter()
    cfg = EngineConfig().with_overrides(**overrides_from_args(args, EngineConfig))
    for flag in ("max_model_len", "max_running"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    kv = KvRequest(args.max_model_len, args.max_running)
    probe, load_plan = plan_ahead(args.model, cfg, kv)
    plan, fp = load_plan.memory, probe.footprint
    print(
        f"{args.model}: {probe.model_type}, {fp.moe_layers} MoE layers x {fp.experts_per_layer} experts (top-{fp.top_k}), "
        f"experts {probe.expert_format} at {fmt_bytes(fp.slot_bytes)} each ({fmt_bytes(fp.experts_bytes)} in all), "
        f"dense {fmt_bytes(fp.dense_bytes)}, checkpoint {fmt_bytes(fp.checkpoint_bytes)} on disk; compute dtype {fp.dtype}"
    )
    print(load_plan.describe())
    print(_kv_pool_line(fp, cfg, kv, args.max_model_len, plan))
    share = plan.n_slots / plan.total_experts
    rows, how = project(
        fp,
        probe.model_type,
        share,
        args.hardware,
        args.link,
        Path(args.trace),
        lambda: measured_costs(probe, cfg),
    )
    print(how)
    if rows:
        first = rows[0][1]
        print(f"  {'policy':15s} {'projected tok/s':>15s} {'x fetch-all':>11s}")
        for name, tps in rows:
            print(f"  {name:15s} {tps:15.2f} {tps / first if first else 0:10.2f}x")
    flags = f"--offload {plan.offload}" + (
        "" if plan.n_slots == plan.total_experts else f" --cache-fraction {share:.3f}"
    )
    for flag in ("max_model_len", "max_running", "kv_tokens"):  # serve reserves the same KV
        if getattr(args, flag) is not None:
            flags += f" --{flag.replace('_', '-')} {getattr(args, flag)}"
    if rows and share < 1.0:
        best = max(rows, key=lambda r: r[1])
        exact = rows[0][1]
        if best[0] != "fetch-all" and best[1] >= 1.2 * exact:
            rec = f"{flags} --policy {best[0]} (projected {best[1] / exact:.1f}x fetch-all; not exact: measure its quality with `moe-offload eval`)"
        else:
            rec = f"{flags} --policy fetch-all (exact; the presets project under 1.2x)"
    else:
        rec = (
            f"{flags} --policy fetch-all (every expert resident: exact at full speed)"
            if share >= 1.0
            else f"{flags} --policy fetch-all"
        )
    print(f"recommended: moe-offload serve --model {args.model} {rec}")
    timed = (
        "; experts read only to time the disk (--hardware measured)"
        if args.hardware == "measured" and rows
        else "; no weights read"
    )
    print(f"(planned from headers in {time.perf_counter() - t0:.1f} s{timed})")
    return 0


# EngineConfig fields that change a memory plan; `plan` takes them as serve does.
PLAN_SETTINGS = (
    "cache_fraction",
    "offload",
    "device_memory",
    "host_memory",
    "device",
    "dtype",
    "expert_quant",
    "dense_quant",
    "quant_cache_dir",
)


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="show the memory placement serve would choose, and projected decode speed",
        description="Read a checkpoint's config.json and safetensors headers (no weights are loaded; --hardware measured reads some experts to time the disk), print the memory plan `serve` would "
        "choose on this machine or on the budgets given, the decode tok/s the router-trace simulator projects for each policy "
        "preset on a hardware profile (labelled projected), and a recommended configuration.",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="Hugging Face model directory (config.json + *.safetensors)",
    )
    p.add_argument(
        "--hardware",
        default=DEFAULT_PROFILE,
        metavar="PROFILE",
        help=f"link and compute costs the projection uses: measured (this CPU: the native kernels' measured speed for the model's dtype and --expert-quant, "
        "and the disk's O_DIRECT rate at expert-sized reads, measured now), or a hardware profile: a name in configs/hardware/ (h200-pcie5, rtx4090-pcie4, "
        f"rtx3090-pcie4, phone-ufs31, this-machine-disk, this-machine-disk-hdd) or a YAML path (default {DEFAULT_PROFILE})",
    )
    p.add_argument(
        "--link",
        metavar="NAME|MBPS[:US]",
        help="replace the profile's slow-tier link for the projection: pcie4, pcie3, nvme, sata-ssd, ufs, usb3, sdcard, hdd, or MB/s with optional latency in us",
    )
    p.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        metavar="NPZ",
        help=f"router trace (`moe-offload trace`) projected onto the checkpoint's shape; its first {SIM_TOKENS} tokens are replayed per preset (default: the embedded model's test-set trace)",
    )
    # The engine settings a plan depends on: EngineConfig's own flags, as serve takes them.
    add_flags(
        p.add_argument_group("engine settings (as serve takes them)"),
        EngineConfig,
        only=PLAN_SETTINGS,
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="context length as serve --max-model-len: the KV reservation covers N tokens per sequence "
        "(default: min(the model's context, 8192))",
    )
    p.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help="sequences decoded together as serve --max-running: the KV reservation covers N of them "
        f"(default: 4, not serve's scheduling default of {CoreLimits.max_running})",
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        metavar="N",
        help="KV-cache tokens to reserve in all, instead of --max-model-len x --max-running",
    )
    p.set_defaults(func=cmd_plan)
