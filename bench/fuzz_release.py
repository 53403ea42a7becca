"""Release check (issue 30): fuzz the whole API of one server with Schemathesis until at least
`--requests` requests went out, then count 5xx answers, responses that leak internals, and
whether the engine process is still the one it started with.

    python -m bench.fuzz_release                      # the embedded model, >= 1000 requests
    python -m bench.fuzz_release --model DIR --requests 1000

Prints one JSON line; exits 1 if any 5xx, leak or engine restart was seen.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.api_fuzz import leaks_in, responses_of, run_schemathesis
from bench.serve_process import RunningServer, serve, server_parser


def main() -> int:
    ap = server_parser(__doc__)
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
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-release-"))
    try:
        with serve(
            ["--model", args.model, "--max-model-len", str(args.max_model_len)],
            tmp / "server.log",
            ready_timeout=300,
        ) as srv:
            return _fuzz(srv, tmp, args.requests, args.examples)
    except RuntimeError as e:  # the server exited or never became ready: its log is in e
        print(e, file=sys.stderr)
        return 1


def _fuzz(srv: RunningServer, tmp: Path, requests: int, examples: int) -> int:
    """Schemathesis rounds (seeds 1, 2, ...) until `requests` went out; prints the JSON line."""
    pid0 = srv.engine_pid()
    statuses: Counter[int] = Counter()
    leaks = rounds = failed_runs = 0
    t0 = time.monotonic()
    while sum(statuses.values()) < requests:
        rounds += 1
        har = tmp / f"round{rounds}.har"
        run = run_schemathesis(srv.base_url, examples, har, seed=rounds)
        failed_runs += run.returncode != 0
        if run.returncode != 0:
            print(run.stdout[-4000:], file=sys.stderr)
        ex = responses_of(har)
        statuses.update(s for _, s, _, _ in ex)
        leaks += len(leaks_in(ex))
    health = httpx.get(srv.base_url + "/health", timeout=10).json()
    pid1 = srv.engine_pid()
    server_errors = sum(n for s, n in statuses.items() if s >= 500)
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
        "server_log_tracebacks": srv.log_path.read_text(errors="replace").count("Traceback"),
    }
    print(json.dumps(result))
    return (
        0
        if server_errors == leaks == failed_runs == 0
        and pid0 == pid1
        and health == {"status": "ready"}
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
