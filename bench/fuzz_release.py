"""Release check (issue 30): fuzz the whole API of one server with Schemathesis until at least
`--requests` requests went out, then count 5xx answers, responses that leak internals, and
whether the engine process is still the one it started with.

    python -m bench.fuzz_release                      # the embedded model, >= 1000 requests
    python -m bench.fuzz_release --model DIR --requests 1000

Prints one JSON line; exits 1 if any 5xx, leak or engine restart was seen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "schemathesis.toml"
LEAKS = re.compile(
    r"Traceback|File \"|\.py\b|site-packages|/(work|home|usr|tmp|opt|root)/|\b(engine|server|torch|transformers|policies)\.[a-z_]+\.|\bline \d+, in\b"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_pid(server_pid: int) -> int | None:
    for kid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
            return int(kid)
    return None


def _exchanges(har: Path) -> list[tuple[str, int, str, str]]:
    out = []
    for e in json.loads(har.read_text())["log"]["entries"]:
        c = e["response"].get("content", {})
        out.append(
            (
                httpx.URL(e["request"]["url"]).path,
                e["response"]["status"],
                c.get("mimeType", ""),
                c.get("text", "") or "",
            )
        )
    return out


def _leaks(ex: list[tuple[str, int, str, str]]) -> int:
    n = 0
    for path, status, ctype, body in ex:
        if status >= 400 or path == "/health":
            n += bool(LEAKS.search(body))
        elif ctype.startswith("text/event-stream"):
            n += any(LEAKS.search(ln) for ln in body.splitlines() if '"error"' in ln)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=str(REPO / "models" / "embedded" / "target"),
        help="model directory (default: the embedded model)",
    )
    ap.add_argument(
        "--requests", type=int, default=1000, help="fuzzed requests to send at least (default 1000)"
    )
    ap.add_argument(
        "--examples",
        type=int,
        default=150,
        help="Schemathesis examples per operation and round (default 150)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=64,
        help="context length, short so that every request is quick (default 64)",
    )
    args = ap.parse_args()
    port = _port()
    base = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-release-"))
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--model",
        args.model,
        "--max-model-len",
        str(args.max_model_len),
    ]
    with open(tmp / "server.log", "wb") as log:
        srv = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None or time.monotonic() > deadline:
                print((tmp / "server.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.3)
        pid0 = _engine_pid(srv.pid)
        statuses: Counter[int] = Counter()
        leaks = rounds = failed_runs = 0
        t0 = time.monotonic()
        while sum(statuses.values()) < args.requests:
            rounds += 1
            har = tmp / f"round{rounds}.har"
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "schemathesis.cli",
                    "--config-file",
                    str(CONFIG),
                    "--no-color",
                    "run",
                    base + "/openapi.json",
                    "--checks",
                    "all",
                    "--max-examples",
                    str(args.examples),
                    "--seed",
                    str(rounds),
                    "--workers",
                    "1",
                    "--generation-database",
                    "none",
                    "--report",
                    "har",
                    "--report-har-path",
                    str(har),
                ],
                cwd=tmp,
                capture_output=True,
                text=True,
                check=False,
            )  # its cache stays out of the repo
            failed_runs += run.returncode != 0
            if run.returncode != 0:
                print(run.stdout[-4000:], file=sys.stderr)
            ex = _exchanges(har)
            statuses.update(s for _, s, _, _ in ex)
            leaks += _leaks(ex)
        health = httpx.get(base + "/health", timeout=10).json()
        pid1 = _engine_pid(srv.pid)
        server_errors = sum(n for s, n in statuses.items() if s >= 500)
        tracebacks = (tmp / "server.log").read_text(errors="replace").count("Traceback")
        result = {
            "requests": sum(statuses.values()),
            "rounds": rounds,
            "seconds": round(time.monotonic() - t0, 1),
            "statuses": dict(sorted(statuses.items())),
            "5xx": server_errors,
            "leaks": leaks,
            "schemathesis_failed_rounds": failed_runs,
            "engine_pid_before": pid0,
            "engine_pid_after": pid1,
            "health": health,
            "server_log_tracebacks": tracebacks,
        }
        print(json.dumps(result))
        return (
            0
            if server_errors == leaks == failed_runs == 0
            and pid0 == pid1
            and health == {"status": "ready"}
            else 1
        )
    finally:
        if srv.poll() is None:
            os.killpg(srv.pid, signal.SIGTERM)
            try:
                srv.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(srv.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
