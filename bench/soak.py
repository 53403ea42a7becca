"""`python -m bench soak`: one server under a bounded mixed load with faults, for a set time.

    python -m bench soak                                  # the embedded model, 10 minutes
    python -m bench soak --duration 120 --kill-every 40   # shorter, more kills
    python -m bench soak --model DIR --out docs/benchmarks

Starts `moe-offload serve` on loopback (bench/serve_process.py), runs the clients of
bench/soak_clients.py in threads (OpenAI chat and completions, Anthropic messages and
count_tokens, Responses chains, mid-stream disconnects, slow readers, oversized bodies),
SIGKILLs the engine every --kill-every seconds, and at --duration sends the server SIGTERM
while the clients are still busy (the drain), then stops.  Every request ends in an Outcome
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
from pathlib import Path
from typing import Any

from bench.report import machine_line
from bench.serve_process import REPO, RunningServer, serve, server_parser
from bench.soak_clients import CLIENTS, Ctx
from bench.soak_monitor import Monitor
from bench.soak_outcomes import Clock
from bench.soak_summary import summarize
from engine.paths import portable_path

# No SIGKILL this close to the drain (or in a short run's second half): a restart took up to
# ~27 s under the soak's load on 2 shared cores, and it must be done before the drain.
KILL_MARGIN_S = 40.0
MAX_BODY = 1024 * 1024  # the server's --max-body-bytes in the soak: oversized bodies stay cheap
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


def _client_loop(name: str, ctx: Ctx, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        CLIENTS[name](ctx, rng)


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


def run_soak(srv: RunningServer, args: argparse.Namespace) -> dict[str, Any]:
    """The load, the faults and the drain against the running server `srv`."""
    clock = Clock()
    ctx = Ctx(srv.base_url, "soak", clock, MAX_BODY)
    last_kill = args.duration - min(KILL_MARGIN_S, args.duration / 2)
    mon = Monitor(srv, clock, args.sample_every, args.kill_every or None, last_kill)
    stop = threading.Event()
    workers = [
        threading.Thread(
            target=_client_loop, args=(n, ctx, args.seed + i, stop), daemon=True, name=f"soak-{n}"
        )
        for i, n in enumerate(CLIENTS)
    ]
    mon.start()
    for w in workers:
        w.start()
    _progress(clock, args.duration, ctx, args.no_progress)
    clock.draining = True  # the clients go on: the drain meets them busy
    t_term = clock.now()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(120)
    drain_s = clock.now() - t_term
    stop.set()
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
        **mon.as_dict(),
    }


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, soak it, and return the raw record with its summary (and write it)."""
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    # Enough restarts for every scheduled kill: the soak tests recovery, not the restart budget.
    kills = int(args.duration // args.kill_every) + 1 if args.kill_every else 0
    server_args = ["--model", args.model, "--served-model-name", "soak"]
    server_args += ["--max-model-len", str(args.max_model_len)]
    server_args += ["--max-body-bytes", str(MAX_BODY), "--engine-restarts", str(kills + 3)]
    if args.read_faults:
        server_args += ["--expert-read-faults", args.read_faults, *READ_FAULT_SERVER_ARGS]
    with tempfile.TemporaryDirectory(prefix="soak-log-") as tmp:
        log = Path(tmp) / "server.log"
        with serve(server_args, log, ready_timeout=300) as srv:
            raw = run_soak(srv, args)
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
    """Read faults the engine injected, by kind, from its log lines (engine/experts/read_faults.py);
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
