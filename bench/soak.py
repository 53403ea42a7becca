"""`python -m bench soak`: one server under a bounded mixed load with faults, for a set time.

    python -m bench soak                                  # the embedded model, 10 minutes
    python -m bench soak --duration 120 --kill-every 40   # shorter, more kills
    python -m bench soak --model DIR --out docs/benchmarks

Starts `moe-offload serve` on loopback (bench/serve_process.py), runs the clients of
bench/soak_clients.py in threads (OpenAI chat and completions, Anthropic messages and
count_tokens, Responses chains, mid-stream disconnects, slow readers, oversized bodies),
SIGKILLs the engine every --kill-every seconds; at --duration pauses the clients until the server
is idle and compares its KV blocks in use and KV/expert split with their level before the load
(bench/soak_idle.py), lets the clients go on for a few seconds, and sends the server SIGTERM
while they are busy (the drain), then stops.  Every request ends in an Outcome
(bench/soak_outcomes.py); the server is sampled over time (bench/soak_monitor.py).  Writes
soak.json and, with --page, soak.md and its plots (bench/soak_page.py).  Exits 1 if any
request was lost or any 5xx was not explained by an injected fault.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.report import machine_line
from bench.serve_process import REPO, RunningServer, serve, server_parser
from bench.soak_agents import AGENT_CONTEXT, agent_session, long_context_copy
from bench.soak_agents import install as install_agent_clis
from bench.soak_clients import CLIENTS, Ctx
from bench.soak_faults import DiskFault, FaultSchedule, MemoryFault
from bench.soak_generated import schemathesis_round
from bench.soak_idle import back_to_idle, read_levels, wait_idle
from bench.soak_monitor import Monitor
from bench.soak_outcomes import Clock
from bench.soak_summary import summarize
from engine import portable_path

# No SIGKILL this close to the drain (or in a short run's second half): a restart took up to
# ~27 s under the soak's load on 2 shared cores, and it must be done before the drain.
KILL_MARGIN_S = 40.0
MAX_BODY = 1024 * 1024  # the server's --max-body-bytes in the soak: oversized bodies stay cheap
DEFAULT_MAX_TOKENS = 64  # the server's --default-max-tokens in the soak
RESUME_S = 5.0  # load again after the idle check, before the SIGTERM drain
MAX_SAMPLES = 300  # samples kept in soak.json (the summary and plots use all of them)
# --read-faults without a value: an EIO every 20 s, a short read every 7 s, a 3 s spike every 30 s.
DEFAULT_READ_FAULTS = "eio:period=20,short:period=7,delay:period=30:secs=3"
# With read faults the experts must be read: the slow tier on disk, half of them in the fast tier.
READ_FAULT_SERVER_ARGS = ["--offload", "disk", "--cache-fraction", "0.5"]


def _parser() -> argparse.ArgumentParser:
    ap = server_parser(__doc__)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument(
        "--kill-every",
        type=float,
        default=120.0,
        help="SIGKILL the engine every S seconds, none in the last 40 s (or half the run); 0: never (default 120)",
    )
    ap.add_argument(
        "--max-kills",
        type=int,
        default=None,
        metavar="N",
        help="at most N SIGKILLs of --kill-every (default: no limit)",
    )
    ap.add_argument(
        "--read-faults",
        nargs="?",
        const=DEFAULT_READ_FAULTS,
        default=None,
        metavar="SPEC",
        help="inject expert read faults on a schedule (the server's --expert-read-faults; its slow tier "
        f"then on disk, half the experts in the fast tier): SPEC, or without one {DEFAULT_READ_FAULTS!r} "
        "(an EIO every 20 s, a short read every 7 s, a 3 s latency spike every 30 s). Default: none",
    )
    ap.add_argument(
        "--memory-fault-every",
        type=float,
        default=0.0,
        metavar="S",
        help="every S s (first at S/2), shrink the server's memory cgroup to its anonymous memory plus "
        "48 MiB for 10 s (bench/soak_faults.py; root and a memory cgroup controller); 0: never (default)",
    )
    ap.add_argument(
        "--disk-full-every",
        type=float,
        default=0.0,
        metavar="S",
        help="every S s (first at 0.8 S), empty and fill the quant cache's tmpfs (the server then runs "
        "--expert-quant int8 with its cache there) and SIGKILL the engine, for 10 s (bench/soak_faults.py; "
        "root: mount); 0: never (default)",
    )
    ap.add_argument(
        "--schemathesis",
        action="store_true",
        help="add a client of Schemathesis rounds generated from the server's /openapi.json "
        "(bench/soak_generated.py)",
    )
    ap.add_argument(
        "--agent-clis",
        action="store_true",
        help="add a client of real Claude Code and Codex CLI sessions (tests/agent_clis.txt, "
        "installed from npm on first use; bench/soak_agents.py); the server then allows 8192-token "
        "contexts, on a copy of the model's config where its own is shorter",
    )
    ap.add_argument(
        "--sample-every", type=float, default=1.0, help="seconds between samples (default 1)"
    )
    ap.add_argument(
        "--max-model-len", type=int, default=512, help="the server's context length (default 512)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (default 0)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for soak.json (and the page with --page); default: a new temporary folder",
    )
    ap.add_argument("--page", action="store_true", help="also write soak.md and its plots to --out")
    ap.add_argument(
        "--requests-json",
        action="store_true",
        help="also write every request's outcome to soak_requests.json in --out (large)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _clients(args: argparse.Namespace) -> dict[str, Callable[[Ctx, random.Random], None]]:
    """The SDK and HTTP clients, and those the flags add."""
    out = dict(CLIENTS)
    if args.schemathesis:
        out["schemathesis"] = schemathesis_round
    if args.agent_clis:
        out["agent_cli"] = agent_session
    return out


def _client_loop(
    step: Callable[[Ctx, random.Random], None],
    ctx: Ctx,
    seed: int,
    stop: threading.Event,
    go: threading.Event,
) -> None:
    """Steps until `stop`; while `go` is clear (the idle check) it starts none."""
    rng = random.Random(seed)
    while not stop.is_set():
        go.wait()
        step(ctx, rng)


def _progress(clock: Clock, duration: float, ctx: Ctx, quiet: bool) -> None:
    """Wait out the load, with a tqdm bar of seconds and the requests counted so far."""
    if quiet:
        time.sleep(max(0.0, duration - clock.now()))
        return
    from tqdm import tqdm

    with tqdm(total=int(duration), unit="s", desc="soak", file=sys.stderr) as bar:
        while (now := clock.now()) < duration:
            time.sleep(min(1.0, duration - now))
            bar.n = int(clock.now())
            bar.set_postfix(requests=len(ctx.records), refresh=False)
            bar.refresh()


def run_soak(
    srv: RunningServer,
    args: argparse.Namespace,
    disk: DiskFault | None = None,
    memory: MemoryFault | None = None,
) -> dict[str, Any]:
    """The load, the faults and the drain against the running server `srv` (whose quant cache is
    on `disk` where --disk-full-every is set, in the cgroup of `memory` where
    --memory-fault-every is)."""
    clock = Clock()
    ctx = Ctx(srv.base_url, "soak", clock, MAX_BODY)
    last_kill = args.duration - min(KILL_MARGIN_S, args.duration / 2)
    mon = Monitor(srv, clock, args.sample_every, args.kill_every or None, last_kill, args.max_kills)
    faults = FaultSchedule(clock, srv.base_url, last_kill)
    if memory is not None:
        memory.srv = srv
        every = args.memory_fault_every
        faults.add(every, every / 2, lambda hc: memory.run(clock, hc))
    if disk is not None:
        every = args.disk_full_every
        faults.add(every, 0.8 * every, lambda hc: disk.run(srv, clock, hc))
    stop, go = threading.Event(), threading.Event()
    go.set()
    workers = [
        threading.Thread(
            target=_client_loop,
            args=(step, ctx, args.seed + i, stop, go),
            daemon=True,
            name=f"soak-{n}",
        )
        for i, (n, step) in enumerate(_clients(args).items())
    ]
    with httpx.Client() as hc:
        before = read_levels(hc, srv.base_url)
    mon.start()
    faults.start()
    for w in workers:
        w.start()
    _progress(clock, args.duration, ctx, args.no_progress)
    idle = _idle_check(srv, before, go)
    clock.draining = True  # the clients go on: the drain meets them busy
    faults.stop()  # a fault still running finishes first: the drain meets a whole server
    t_term = clock.now()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(120)
    drain_s = clock.now() - t_term
    stop.set()
    ctx.stopped.set()
    for w in workers:
        w.join(70)
    mon.stop()
    records = [r.as_dict() for r in ctx.records]
    return {
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "drain": {"t": t_term, "seconds": drain_s, "exit_code": code},
        "still_running": [w.name for w in workers if w.is_alive()],
        "requests": records,
        "faults": faults.as_list(),
        "idle": idle,
        **mon.as_dict(),
    }


def _idle_check(
    srv: RunningServer, before: dict[str, Any] | None, go: threading.Event
) -> dict[str, Any]:
    """Pause the clients until the server is idle, compare its KV and split with `before`
    (bench/soak_idle.py), then let them go on for RESUME_S so the drain meets them busy."""
    go.clear()
    with httpx.Client() as hc:
        idle = back_to_idle(before, wait_idle(hc, srv.base_url))
    go.set()
    time.sleep(RESUME_S)
    return idle


def _server_args(args: argparse.Namespace, tmp: Path, disk: DiskFault | None) -> list[str]:
    """`moe-offload serve` flags for this soak (a long-context copy of the model goes to tmp)."""
    # Enough restarts for every scheduled kill: the soak tests recovery, not the restart budget.
    kills = int(args.duration // args.kill_every) + 1 if args.kill_every else 0
    kills = min(kills, args.max_kills) if args.max_kills is not None else kills
    # A shrunk cgroup or a full disk may cost several failed starts each (the supervisor's backoff).
    for every in (args.memory_fault_every, args.disk_full_every):
        kills += 6 * (int(args.duration // every) + 1) if every else 0
    model, max_len = args.model, args.max_model_len
    if args.agent_clis:  # their first prompt is ~5,200 tokens: a context that holds it
        install_agent_clis()
        model = str(long_context_copy(Path(args.model), tmp))
        max_len = max(max_len, AGENT_CONTEXT)
    server_args = ["--model", model, "--served-model-name", "soak"]
    server_args += ["--max-model-len", str(max_len)]
    server_args += ["--max-body-bytes", str(MAX_BODY), "--engine-restarts", str(kills + 3)]
    # A request without max_tokens (Codex's, many of Schemathesis's) stops here, not at the context.
    server_args += ["--default-max-tokens", str(DEFAULT_MAX_TOKENS)]
    if args.read_faults:
        server_args += ["--expert-read-faults", args.read_faults, *READ_FAULT_SERVER_ARGS]
    return server_args + (disk.server_args() if disk is not None else [])


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, soak it, and return the raw record with its summary (and write it)."""
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    disk = DiskFault() if args.disk_full_every else None
    memory = MemoryFault(args.max_model_len) if args.memory_fault_every else None
    enter = memory.enter if memory is not None else None
    with tempfile.TemporaryDirectory(prefix="soak-log-") as tmp:
        log = Path(tmp) / "server.log"
        try:
            with serve(_server_args(args, Path(tmp), disk), log, 300, enter) as srv:
                raw = run_soak(srv, args, disk, memory)
        finally:
            for fault in (disk, memory):
                if fault is not None:
                    fault.close()
        text = log.read_text(errors="replace")
        raw["read_faults"] = {"spec": args.read_faults, "injected": injected_read_faults(text)}
        tail = text[-3000:]  # no machine paths in a committed record
        raw["server_log_tail"] = _scrub(tail, {str(REPO): ".", tmp: "<tmp>"})
    raw["machine"] = machine_line(1, "server started with OMP_NUM_THREADS=1")
    argv = sys.argv[1:]
    argv = [
        portable_path(a) if i and argv[i - 1] in ("--out", "--model") else a
        for i, a in enumerate(argv)
    ]
    raw["command"] = " ".join(["python -m bench soak", *argv])
    raw["summary"] = summarize(raw)
    if args.page:
        from bench.soak_page import write_page

        write_page(raw, out)  # its plots use every sample
    write_record(raw, out, args.requests_json)
    return raw


def injected_read_faults(log: str) -> dict[str, int]:
    """Read faults the engine injected, by kind, from its log lines (engine/experts/tiers/read_faults.py);
    every engine process of the run counts, a restarted one too."""
    found = re.findall(r"injected expert read fault: (\w+)", log)
    return dict(Counter(found))


def _scrub(text: str, more: dict[str, str]) -> str:
    """`text` without this machine's paths: the repository, the temporary folder, the Python
    environment and installation (tracebacks in the server's log name their files)."""
    for path, name in {**more, sys.prefix: "<venv>", sys.base_prefix: "<python>"}.items():
        text = text.replace(path, name)
    return text


def _thin(xs: list[Any]) -> list[Any]:
    """At most MAX_SAMPLES of `xs`, evenly spaced."""
    return xs[:: max(1, -(-len(xs) // MAX_SAMPLES))]


def write_record(raw: dict[str, Any], out: Path, with_requests: bool) -> None:
    """soak.json: everything but the per-request records, at most MAX_SAMPLES samples and /health
    probes (evenly spaced), so the page's record stays small; with `with_requests`, soak_requests.json too
    (about 150 bytes a request)."""
    slim = {k: v for k, v in raw.items() if k != "requests"}
    slim["samples"] = _thin(raw["samples"])
    slim["health"] = _thin(raw.get("health", []))
    (out / "soak.json").write_text(json.dumps(slim, separators=(",", ":")))
    if with_requests:
        (out / "soak_requests.json").write_text(json.dumps(raw["requests"], separators=(",", ":")))


def passed(raw: dict[str, Any]) -> bool:
    s = raw["summary"]
    return s["lost"] == 0 and s["unexplained_5xx"] == 0 and not raw["still_running"]


def main() -> int:
    raw = execute(_parser().parse_args())
    print(json.dumps(raw["summary"], indent=1))
    return 0 if passed(raw) else 1


if __name__ == "__main__":
    raise SystemExit(main())
