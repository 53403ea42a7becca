"""Decode speed of this checkout against another git revision, on the same checkpoint, side by side.

What a change did to the engine's own speed, measured the way this project's shared machine allows:
each revision decodes in its own process (a `git worktree` of the base revision, imported ahead of the
installed package), rounds alternate which revision runs first (two processes of the same code measured
13 % apart, in the same direction every round, when the order was fixed), and each process warms up
before it measures. Reports each round's tok/s and the ratio this checkout / base, per round and median.

    python -m bench.revision_ab --base c500117 --shape tiny --rounds 6
    python -m bench.revision_ab --base HEAD~3 --shape mid --rounds 4 --dtype bfloat16
    python -m bench.revision_ab --base HEAD~3 --shape mid --workload batch8   # or window3, window5

The checkpoint is bench/peers.py's random qwen3_moe of `--shape` (built once under `--work`); the engine
runs at `--cache-fraction` (default 1.0) over `--offload`, prefetch none, 1 thread by default. The base revision must load that checkpoint
with the same API (engine.worker.loader.load_model, engine.core.completion.generate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from bench.peers import SHAPES, checkpoint

CHILD = """
import importlib, inspect, json, sys, time, torch
from engine.config import EngineConfig
from engine.core.completion import complete, generate
from engine.core.engine_core import CoreLimits, EngineCore
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model
from engine.worker.runner import ModelRunner, truncate_cache
from engine.worker.sampling import SamplingParams
ckpt, dtype, tokens, reps, threads, workload = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
fraction, offload = float(sys.argv[7]), sys.argv[8]
torch.set_num_threads(threads)
om = load_model(ckpt, EngineConfig(cache_fraction=fraction, offload=offload, dtype=dtype, prefetch="none"))
prompt = list(range(5, 21))

def decode(n):
    return generate(om, prompt, SamplingParams(max_tokens=n + 1, ignore_eos=True)).decode_tokens_per_s

def batch(n, streams=8):  # aggregate decode tok/s of 8 requests decoding together
    core = EngineCore.for_model(om, CoreLimits(max_running=streams, prefill_token_budget=4096, max_model_len=4096))
    # The core names its requests; a revision before EngineCore.local_request had a module-level request().
    make = getattr(core, "local_request", None) or importlib.import_module("engine.core.completion").request
    done = complete(core, [make([5 + i] + prompt, SamplingParams(max_tokens=n + 1, ignore_eos=True)) for i in range(streams)])
    start, end = max(c.t_first for c in done), max(c.t_end for c in done)
    return sum(len(c.token_ids) - 1 for c in done) / (end - start)

def window(rows, n):  # verified rows per second: a window of `rows` after the prompt, rolled back, n times
    runner, cache = ModelRunner(om), new_kv_cache(om.config)
    runner.forward([prompt], [0], [cache], [[len(prompt) - 1]])
    # A verification step's kind, where the revision's forward takes one (its kernels and path counter).
    kind = {"kind": "verify"} if "kind" in inspect.signature(runner.forward).parameters else {}
    win, t0 = list(range(30, 30 + rows)), time.perf_counter()
    for _ in range(n):
        runner.forward([win], [len(prompt)], [cache], [list(range(rows))], **kind)
        truncate_cache(cache, len(prompt))
    return rows * n / (time.perf_counter() - t0)

run = {"decode": decode, "batch8": batch, "window3": lambda n: window(3, n), "window5": lambda n: window(5, n)}[workload]
run(32)  # warm-up: the native kernels' first calls check themselves, caches fill
om.stats.reset()
tps = [run(tokens) for _ in range(reps)]
print("RESULT", json.dumps({"tps": tps, "steps": om.stats.snapshot().get("steps")}))
"""


def measure(tree: Path, ckpt: Path, args: argparse.Namespace) -> tuple[float, float | None]:
    """(median tok/s of `args.reps` runs of the workload in a fresh process importing the engine from `tree`, the
    share of its forwards that took the fused path, or None where that revision does not count paths)."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(ckpt),
            args.dtype,
            str(args.tokens),
            str(args.reps),
            str(args.threads),
            args.workload,
            str(args.cache_fraction),
            args.offload,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if res.returncode != 0 or "RESULT" not in res.stdout:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"revision_ab: the run in {tree} failed ({tail}); check that the revision loads this checkpoint"
        )
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    steps = out["steps"]
    fused = (
        None
        if steps is None
        else (
            sum(p.get("fused", 0) for p in steps.values())
            / max(1, sum(sum(p.values()) for p in steps.values()))
        )
    )
    return statistics.median(out["tps"]), fused


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--base",
        required=True,
        help="the git revision to compare this checkout against (a commit, tag or branch)",
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="bench/peers.py checkpoint shape (default tiny)",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="compute dtype (default float32)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="rounds; each runs both revisions, alternating which first (default 6)",
    )
    ap.add_argument(
        "--tokens", type=int, default=128, help="decode tokens per generate (default 128)"
    )
    ap.add_argument(
        "--reps", type=int, default=2, help="generates per process, their median kept (default 2)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and native threads (default 1: steadier on a shared machine)",
    )
    ap.add_argument(
        "--cache-fraction",
        type=float,
        default=1.0,
        help="share of the routed experts in the fast tier (default 1.0: all resident)",
    )
    ap.add_argument(
        "--offload",
        choices=("auto", "ram", "disk"),
        default="auto",
        help="the slow tier below a partial fast tier (default auto)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/peers"),
        help="where the checkpoint is built (default .cache/peers)",
    )
    ap.add_argument(
        "--workload",
        choices=("decode", "batch8", "window3", "window5"),
        default="decode",
        help="decode: one request's decode tok/s (default); batch8: 8 requests decoding together, aggregate tok/s; "
        "window3, window5: verification windows of 3 or 5 rows after a prompt, verified rows per second",
    )
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--verify", f"{args.base}^{{commit}}"],
            cwd=here,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        raise SystemExit(
            "revision_ab: needs git (apt-get install git) and a git checkout of this repository"
        ) from None
    if rev.returncode != 0:
        raise SystemExit(
            f"revision_ab: {args.base!r} is not a commit of this repository; pass --base with a commit, tag or branch"
        )
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args.work, args.shape).resolve()
    with tempfile.TemporaryDirectory(prefix="revision-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), rev.stdout.strip()],
            cwd=here,
            check=True,
            capture_output=True,
        )
        try:
            trees = {"base": base_tree, "this checkout": here}
            tps: dict[str, list[float]] = {name: [] for name in trees}
            fused: dict[str, float | None] = {}
            for r in tqdm(range(args.rounds), desc="rounds"):
                for name, tree in list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]:
                    speed, fused[name] = measure(tree, ckpt, args)
                    tps[name].append(speed)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base_tree)],
                cwd=here,
                capture_output=True,
            )
    ratios = [a / b for a, b in zip(tps["this checkout"], tps["base"])]
    print(
        f"{args.shape} {args.dtype} {args.workload}, {args.threads} thread(s), {args.tokens} tokens, base {args.base} "
        f"({rev.stdout.strip()[:10]})"
    )
    for name, values in tps.items():
        share = "not counted by this revision" if fused[name] is None else f"{fused[name]:.0%}"
        print(
            f"  {name:14s} tok/s per round: {', '.join(f'{v:.1f}' for v in values)}; fused steps {share}"
        )
    print(
        f"  this checkout / base per round: {', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
