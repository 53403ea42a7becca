"""`python -m bench restart-time`: how long a server stops serving after an engine SIGKILL, and where
an engine start's time goes.

    python -m bench restart-time                       # the embedded model, 3 rounds of 3 kills
    python -m bench restart-time --rounds 2 --kills 2 --out docs/benchmarks

Each round runs every variant in turn, interleaved so the shared machine's load meets them alike:
`spawn` (`--no-engine-preload`: each engine a spawned process that imports torch, transformers and
the engine itself, the start path before server/engine_spawn.py) and `forkserver` (the default:
engines forked from a process that imported them once). For each, a server starts, then its engine
is SIGKILLed `--kills` times; each time, the seconds until /health says ready again and a
completion succeeds. The restart window is 1 s, so every restart waits the first backoff (1 s) in
both variants, as the first SIGKILL of a run does (server/engine_client.py).

Each round also times, in a fresh process, what a spawned engine does before it serves: import
torch, transformers and the engine's modules, then load the model (`phases`).
Prints a JSON summary (medians per variant); --out also writes restart_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import machine_line
from bench.serve_process import REPO, RunningServer, serve, server_parser

VARIANTS = {"spawn": ["--no-engine-preload"], "forkserver": []}
# What a spawned engine does before it serves, phase by phase (run in a fresh interpreter).
PHASES = """
import json, sys, time
t = [time.perf_counter()]
import torch; t.append(time.perf_counter())
import transformers; t.append(time.perf_counter())
import engine.launch, engine.worker.loader, engine.core.engine_core, engine.speculative.factory, cli.main
t.append(time.perf_counter())
from engine.config import EngineConfig
engine.worker.loader.load_model(sys.argv[1], EngineConfig(device="cpu")).close()
t.append(time.perf_counter())
names = ["import torch", "import transformers", "import the engine and cli.main", "load the model"]
print(json.dumps({n: b - a for n, a, b in zip(names, t, t[1:])}))
"""


def _parser() -> argparse.ArgumentParser:
    ap = server_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every variant (default 3)")
    ap.add_argument("--kills", type=int, default=3, help="engine SIGKILLs per server (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="folder for restart_time.json")
    return ap


def _serving(srv: RunningServer) -> bool:
    try:
        if httpx.get(srv.base_url + "/health", timeout=5).status_code != 200:
            return False
        body = {"model": "m", "prompt": "Hello", "max_tokens": 2}
        return (
            httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
        )
    except httpx.HTTPError:
        return False


def _restart_seconds(srv: RunningServer, timeout: float = 120.0) -> float:
    """SIGKILL the engine; seconds until the server serves again (health ready, a completion done)."""
    pid = srv.engine_pid()
    assert pid is not None, "no engine process found"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while srv.engine_pid() == pid or _health_ok(srv):  # until the front end has seen the death
        time.sleep(0.01)
    while not _serving(srv):
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"not serving {timeout} s after the SIGKILL:\n{srv.log()}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _health_ok(srv: RunningServer) -> bool:
    try:
        return httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _phases(model: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PHASES, model],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    restarts: dict[str, list[float]] = {v: [] for v in VARIANTS}
    phases: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="restart-time-") as tmp:
        for r in range(args.rounds):
            for name, flags in VARIANTS.items():
                server_args = ["--model", args.model, "--served-model-name", "m"]
                server_args += ["--engine-restart-window", "1", "--engine-restarts", "100"]
                with serve(server_args + flags, Path(tmp) / f"{name}-{r}.log", 300) as srv:
                    for _ in range(args.kills):
                        restarts[name].append(_restart_seconds(srv))
            phases.append(_phases(args.model))
    return {
        "restart_s": restarts,
        "restart_median_s": {v: statistics.median(xs) for v, xs in restarts.items()},
        "phases_s": phases,
        "phases_median_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "machine": machine_line(1, "servers started with OMP_NUM_THREADS=1"),
        "command": " ".join(["python -m bench restart-time", *sys.argv[1:]]),
    }


def main() -> int:
    args = _parser().parse_args()
    raw = measure(args)
    print(json.dumps(raw, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "restart_time.json").write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
