"""Decode speed of this checkout against another git revision, on the same checkpoint, side by side.

What a change did to the engine's own speed, measured the way this project's shared machine allows:
each revision decodes in its own process (a `git worktree` of the base revision, imported ahead of the
installed package), rounds alternate which revision runs first (two processes of the same code measured
13 % apart, in the same direction every round, when the order was fixed), and each process warms up
before it measures. Reports each round's tok/s and the ratio this checkout / base, per round and median.

    python -m bench.revision_ab --base c500117 --shape tiny --rounds 6
    python -m bench.revision_ab --base HEAD~3 --shape mid --rounds 4 --dtype bfloat16

The checkpoint is bench/peers.py's random qwen3_moe of `--shape` (built once under `--work`); the engine
runs at cache 1.0, prefetch none, 1 thread by default. The base revision must load that checkpoint
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
import json, sys, torch
from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams
ckpt, dtype, tokens, reps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
om = load_model(ckpt, EngineConfig(cache_fraction=1.0, dtype=dtype, prefetch="none"))
prompt = list(range(5, 21))
run = lambda n: generate(om, prompt, SamplingParams(max_tokens=n + 1, ignore_eos=True)).decode_tokens_per_s
run(32)  # warm-up: the native kernels' first calls check themselves, caches fill
print("RESULT", json.dumps([run(tokens) for _ in range(reps)]))
"""


def measure(tree: Path, ckpt: Path, args: argparse.Namespace) -> float:
    """Median decode tok/s of `args.reps` generates in a fresh process importing the engine from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    res = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), args.dtype, str(args.tokens), str(args.reps), str(args.threads)],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0 or "RESULT" not in res.stdout:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"revision_ab: the run in {tree} failed ({tail}); check that the revision loads this checkpoint")
    return statistics.median(json.loads(res.stdout.split("RESULT", 1)[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision to compare this checkout against (a commit, tag or branch)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="bench/peers.py checkpoint shape (default tiny)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (default float32)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds; each runs both revisions, alternating which first (default 6)")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens per generate (default 128)")
    ap.add_argument("--reps", type=int, default=2, help="generates per process, their median kept (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch and native threads (default 1: steadier on a shared machine)")
    ap.add_argument("--work", type=Path, default=Path(".cache/peers"), help="where the checkpoint is built (default .cache/peers)")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.base}^{{commit}}"], cwd=here, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit("revision_ab: needs git (apt-get install git) and a git checkout of this repository") from None
    if rev.returncode != 0:
        raise SystemExit(f"revision_ab: {args.base!r} is not a commit of this repository; pass --base with a commit, tag or branch")
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args.work, args.shape).resolve()
    with tempfile.TemporaryDirectory(prefix="revision-ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), rev.stdout.strip()], cwd=here, check=True, capture_output=True)
        try:
            trees = {"base": base_tree, "this checkout": here}
            tps: dict[str, list[float]] = {name: [] for name in trees}
            for r in tqdm(range(args.rounds), desc="rounds"):
                for name, tree in (list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]):
                    tps[name].append(measure(tree, ckpt, args))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=here, capture_output=True)
    ratios = [a / b for a, b in zip(tps["this checkout"], tps["base"])]
    print(f"{args.shape} {args.dtype}, {args.threads} thread(s), {args.tokens} tokens, base {args.base} ({rev.stdout.strip()[:10]})")
    for name, values in tps.items():
        print(f"  {name:14s} tok/s per round: {', '.join(f'{v:.1f}' for v in values)}")
    print(f"  this checkout / base per round: {', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
