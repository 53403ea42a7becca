"""Measure this machine's hardware profile for the simulator (configs/hardware/this-machine-*.yaml).

What it measures, all on the embedded model through the engine itself (so the numbers include
the engine's Python and dispatch costs, which dominate such small experts):
- dense time per layer and step, and per-expert fast-tier compute: plain greedy decode at cache 1.0
  (every expert resident) with 1, 4, 8 and 16 streams; forward hooks time every MoE block (router +
  experts) and the routing bus says how many distinct experts and rows each block call ran. The
  rest of the step (attention, norms, embeddings, LM head, sampling, scheduling) is divided over
  the MoE layers as "dense per layer", fitted as a + b·rows over the two stream counts.
- the slow-tier read: the engine's own transfer seconds (read with O_DIRECT + conversion into a
  slot) at cache 0.25 on disk, plain fetch-all decode, and, from the same run, the compute thread's
  extra time per demand load (what it spends beyond the cache-1.0 step and the recorded stall:
  running a landed expert outside the grouped path, lock hand-offs, contention for the 2 cores);
- the CPU-run path: the engine's cost meter fit h0 + h1·rows at cache 0.25 on disk with
  --cpu-experts all (read from the host tier + conversion + compute);
- one draft step: the draft proposer's forward timed around `_propose`, divided by the tokens proposed,
  and the dense part of a verification window (k = 4: one request, 5 rows) from the same runs;
- the disk's sequential bandwidth: O_DIRECT reads of 1 MiB from the checkpoint;
- the utility estimator's Python bookkeeping per step (observe, histogram, a ranked() per layer);
- the projected shapes' expert and dense GEMMs in fp32 on 1 thread (`--shapes-only` runs just these).

    python -m bench.measure_hardware --out docs/benchmarks/this_machine_profile.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import cut_prompts
from bench.spec_bench import run_cell
from engine import (
    DraftProposer,
    EngineConfig,
    OffloadedMoeBlock,
    RoutingEvent,
    SpecConfig,
    load_model,
)
from models import EMBEDDED_TARGET

OFF = SpecConfig(speculative="off")


def _timed_cell(om, prompts: list[list[int]], tokens: int, spec: SpecConfig = OFF) -> dict:  # noqa: C901
    """run_cell with every MoE block call timed and its routing recorded (decode phase only)."""
    calls: list[tuple[float, int, int]] = []  # (seconds, distinct experts, rows)
    pending: list[RoutingEvent] = []
    blocks = [m for m in om.model.modules() if isinstance(m, OffloadedMoeBlock)]

    def timed(
        seconds: float, rows: int
    ) -> None:  # after each block call: its routing was published during it
        ev = pending.pop() if pending else None
        if ev is not None:
            calls.append((seconds, len(set(ev.ids.reshape(-1).tolist())), ev.ids.shape[0]))

    for b in blocks:
        b.timers.append(timed)
    unsubscribe = om.bus.subscribe(pending.append)
    try:
        r = run_cell(om, spec, prompts, tokens)
    finally:
        unsubscribe()
        for b in blocks:
            b.timers.remove(timed)
    # run_cell resets stats after the prompts: drop calls of prefill-sized blocks (> streams·(k+1) rows)
    r["calls"] = [c for c in calls if c[2] <= len(prompts) * 8]
    return r


def time_gemms(hidden: int, inter: int, rows: int, repeats: int = 20) -> float:
    """Seconds for one SwiGLU expert (fp32, the CPU's compute dtype) over `rows` rows."""
    wg, wu, wd = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(rows, hidden)
    F = torch.nn.functional
    for _ in range(3):
        F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    t0 = time.perf_counter()
    for _ in range(repeats):
        F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    return (time.perf_counter() - t0) / repeats


def seq_read_mb_s(model_dir: Path, chunk: int = 1 << 20, n: int = 32) -> float:
    """Sequential O_DIRECT reads of `chunk` bytes from the checkpoint, as the disk tier reads (MB/s)."""
    from engine import UncachedReader

    path = next(Path(model_dir).glob("*.safetensors"))
    reader = UncachedReader(True)
    n = min(n, path.stat().st_size // chunk)
    t0 = time.perf_counter()
    for i in range(n):
        reader.read(path, i * chunk, chunk)
    reader.close()
    return chunk * n / (time.perf_counter() - t0) / 1e6


def utility_step_s(
    rows: int = 5, layers: int = 4, experts: int = 64, top_k: int = 8, steps: int = 200
) -> float:
    """Seconds per step of the engine's utility bookkeeping in Python: SpeculativeUtilityEstimator
    .observe on one window's counts, the level histogram, and one ranked() per layer (the top-ups)."""
    import random

    from policies.utility import SpeculativeUtilityEstimator

    est, rng = SpeculativeUtilityEstimator(experts), random.Random(0)
    reports = []
    for _ in range(steps):
        report = {}
        for layer in range(layers):
            tot = [0] * experts
            for _ in range(rows):
                for e in rng.sample(range(experts), top_k):
                    tot[e] += 1
            report[layer] = (tot, tot)
        reports.append(report)
    t0 = time.perf_counter()
    for rep in reports:
        est.observe(rep)
        est.histogram(range(layers))
        for layer in range(layers):
            est.ranked(layer, 1)
    return (time.perf_counter() - t0) / steps


def measure_shapes() -> dict:
    """Per-expert and dense-layer GEMM time of the projected shapes on this CPU (1 thread): what the
    profile charges when the embedded model's engine overheads are not measurable for a shape."""
    from engine import SHAPES

    out = {}
    for name in ("qwen3-30b-a3b", "qwen3-next-80b-a3b"):
        sh = SHAPES[name]
        t1, t8 = (
            statistics.median(time_gemms(sh.hidden, sh.moe_intermediate, 1) for _ in range(3)),
            statistics.median(time_gemms(sh.hidden, sh.moe_intermediate, 8) for _ in range(3)),
        )
        # Dense part: a GEMV over the layer's dense parameters (+ its share of the LM head) as one square-ish matrix.
        params = sh.dense_params_per_layer + sh.head_params / sh.layers
        w = torch.randn(int(params // sh.hidden), sh.hidden)
        x1, x8 = torch.randn(1, sh.hidden), torch.randn(8, sh.hidden)

        def lin(x: torch.Tensor, w: torch.Tensor = w) -> float:
            torch.nn.functional.linear(x, w)
            t0 = time.perf_counter()
            for _ in range(5):
                torch.nn.functional.linear(x, w)
            return (time.perf_counter() - t0) / 5

        d1, d8 = lin(x1), lin(x8)
        out[name] = {
            "expert_a_s": t1 - (t8 - t1) / 7,
            "expert_b_s": (t8 - t1) / 7,
            "dense_a_s": d1 - (d8 - d1) / 7,
            "dense_b_s": (d8 - d1) / 7,
        }
    return out


def measure_window(
    args: argparse.Namespace, ram=None, prompts: list[list[int]] | None = None
) -> dict:
    """The draft's time per proposed token and the target's dense time per layer of a k = 4
    verification window (one request, ~5 rows) against a plain one-row step (cache 1.0, one stream)."""
    own = ram is None
    if own:
        ram = load_model(EMBEDDED_TARGET, EngineConfig(cache_fraction=1.0))
        prompts = cut_prompts(ram.tokenizer, args.data, 1, 64)
    assert prompts is not None
    out: dict = {}
    spent: list[float] = []
    orig = DraftProposer._propose

    def timed_propose(self, plan):
        t0 = time.perf_counter()
        proposed = orig(self, plan)
        spent.append(time.perf_counter() - t0)
        return proposed

    DraftProposer._propose = timed_propose  # type: ignore[method-assign]
    windows = []
    try:
        for _ in range(args.repeats + 1):
            # A plain one-stream cell and a k = 4 cell back to back, so both see the same machine load.
            plain = _timed_cell(ram, prompts[:1], args.tokens)
            d_plain = (
                plain["produced"] / plain["tok_s"] - sum(c[0] for c in plain["calls"])
            ) / len(plain["calls"])
            spent.clear()
            r = _timed_cell(
                ram,
                prompts[:1],
                args.tokens,
                SpecConfig(speculative="draft", num_speculative_tokens=4, adaptive=False),
            )
            wall, calls = r["produced"] / r["tok_s"], r["calls"]
            # The target's dense part per layer of a verification window (one request, ~5 rows).
            d_win = (wall - sum(spent) - sum(c[0] for c in calls)) / len(calls)
            rows = statistics.mean(c[2] for c in calls)
            windows.append(
                {
                    "dense_per_layer_s": d_win,
                    "plain_dense_per_layer_s": d_plain,
                    "rows": rows,
                    "extra_per_row_s": (d_win - d_plain) / max(rows - 1, 1e-9),
                    "draft_token_s": statistics.median(spent) / 4,
                }
            )
    finally:
        DraftProposer._propose = orig  # type: ignore[method-assign]
    windows = windows[1:]
    out["draft_token_s"] = statistics.median(w["draft_token_s"] for w in windows)
    out["draft_k4"] = {
        "tokens_per_verification": r["tokens_per_verification"],
        "acceptance_by_position": r["acceptance_by_position"],
    }
    # Extra dense time per row beyond one per request: a window's rows share its request's
    # attention call, sampling and scheduling, so they cost less than as many requests.
    out["dense_window"] = {k: statistics.median(w[k] for w in windows) for k in windows[0]}
    if own:
        ram.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data", default="models/embedded/data/test.txt", help="text the prompts are cut from"
    )
    ap.add_argument(
        "--tokens", type=int, default=48, help="greedy tokens per request and cell (default 48)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="repeats of each cell; medians are reported (default 3)",
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1, as the benchmarks)"
    )
    ap.add_argument("--out", type=Path, help="write the measured numbers as JSON here")
    ap.add_argument(
        "--shapes-only",
        action="store_true",
        help="only time the projected shapes' expert and dense GEMMs",
    )
    ap.add_argument(
        "--window-only",
        action="store_true",
        help="only the draft token and the verification window's dense time (cache 1.0)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.shapes_only:
        print(json.dumps(measure_shapes(), indent=2))
        return
    if args.window_only:
        print(json.dumps(measure_window(args), indent=2))
        return

    ram = load_model(EMBEDDED_TARGET, EngineConfig(cache_fraction=1.0))
    L = len(ram.moe_layers)
    prompts = cut_prompts(ram.tokenizer, args.data, 8, 64)
    res: dict = {
        "machine": f"{platform.machine()}, {args.threads} torch thread(s), torch {torch.__version__}, {platform.python_version()}"
    }

    # 1) cache 1.0: step time, MoE block time vs distinct experts and rows.
    per_streams = {}
    prompts = cut_prompts(ram.tokenizer, args.data, 16, 64)
    for n in (1, 4, 8, 16):
        runs = [_timed_cell(ram, prompts[:n], args.tokens) for _ in range(args.repeats + 1)][
            1:
        ]  # first is warm-up
        step_s = statistics.median(n * 1.0 / r["tok_s"] for r in runs)  # every step makes n tokens
        calls = [c for r in runs for c in r["calls"] if c[2] == n]
        moe_s = statistics.median(c[0] for c in calls)
        distinct = statistics.mean(c[1] for c in calls)
        per_streams[n] = {
            "step_s": step_s,
            "moe_block_s": moe_s,
            "distinct": distinct,
            "rows": n,
            "dense_per_layer_s": (step_s - L * moe_s) / L,
        }
    res["ram"] = per_streams
    # Per-expert cost on the fast tier: single-row path (rows 1: 8 experts per call) and the
    # grouped path (8 rows: ~42 experts, 64 row-slots).
    one, eight = per_streams[1], per_streams[8]
    g_single = one["moe_block_s"] / one["distinct"]
    res["fast_expert_single_row_s"] = g_single
    res["fast_expert_grouped_s_per_expert"] = eight["moe_block_s"] / eight["distinct"]
    # Dense per layer = a + b.rows, least squares over 1, 4, 8 and 16 rows.
    xs = np.array(sorted(per_streams), dtype=float)
    ys = np.array([per_streams[int(n)]["dense_per_layer_s"] for n in xs])
    b, a = np.polyfit(xs, ys, 1)
    res["dense_fit"] = {"a_s": float(a), "b_s_per_row": float(b)}

    # 2) draft: time per proposed token, and a verification window's dense time.
    res.update(measure_window(args, ram, prompts))
    ram.close()

    # 3) cache 0.25 on disk: transfer seconds and the compute thread's extra time per load.
    disk = load_model(
        EMBEDDED_TARGET, EngineConfig(cache_fraction=0.25, offload="disk", prefetch="none")
    )
    reps = []
    for _ in range(args.repeats + 1):
        r = run_cell(disk, OFF, prompts[:1], args.tokens)
        s = r["stats"]
        loads = s["transfers"].get("demand", 0)
        wall = r["produced"] / r["tok_s"]
        reps.append(
            {
                "read_s": s["transfer_seconds"].get("demand", 0.0) / max(loads, 1),
                "loads_per_token": loads / r["produced"],
                "stall_s_per_token": s["stall_seconds"] / r["produced"],
                "step_s": wall / r["produced"],
                "extra_per_load_s": (wall - s["stall_seconds"] - r["produced"] * one["step_s"])
                / max(loads, 1),
            }
        )
    reps = reps[1:]
    res["disk"] = {k: statistics.median(x[k] for x in reps) for k in reps[0]}
    disk.close()

    # 4) CPU-run experts: the engine's own cost-meter fit (read + convert + compute on a CPU worker).
    cpu = load_model(
        EMBEDDED_TARGET,
        EngineConfig(cache_fraction=0.25, offload="disk", cpu_experts="all", prefetch="none"),
    )
    for _ in range(args.repeats):
        run_cell(cpu, OFF, prompts[:8], args.tokens // 2)
        run_cell(cpu, OFF, prompts[:1], args.tokens // 2)
    h = cpu.executor.meter.cpu.coefficients() if cpu.executor.meter is not None else None
    res["cpu_expert_fit"] = {"h0_s": h[0], "h1_s_per_row": h[1]} if h else None
    cpu.close()

    res["seq_read_mb_s"] = seq_read_mb_s(Path(EMBEDDED_TARGET))
    res["utility_step_s"] = {
        rows: statistics.median(utility_step_s(rows) for _ in range(3)) for rows in (1, 5, 40)
    }
    res["shapes"] = measure_shapes()
    print(json.dumps(res, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
