"""Schemathesis over a running server's own /openapi.json, and the search of its answers for
leaked internals: shared by tests/test_openapi_fuzz.py and bench/fuzz_release.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "schemathesis.toml"
# What must never reach a client: tracebacks, source files, paths, module names.
LEAKS = re.compile(
    r"Traceback|File \"|\.py\b|site-packages|/(work|home|usr|tmp|opt|root)/|\b(engine|server|torch|transformers|policies)\.[a-z_]+\.|\bline \d+, in\b"
)


def run_schemathesis(
    base_url: str,
    examples: int,
    har: Path,
    seed: int = 1,
    timeout: float | None = None,
    request_timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """The Schemathesis CLI over the server's own document: all checks, seeded, bounded; every
    exchange written to the HAR report `har`. `timeout` bounds the whole run, `request_timeout`
    each request (Schemathesis's default: 10 s)."""
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG),
        "--no-color",
        "run",
        base_url + "/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(examples),
        "--seed",
        str(seed),
        "--workers",
        "1",
        "--generation-database",
        "none",
        "--report",
        "har",
        "--report-har-path",
        str(har),
    ]
    if request_timeout is not None:
        cmd += ["--request-timeout", str(request_timeout)]
    # cwd: Schemathesis keeps a cache directory where it runs; not in the repository.
    return subprocess.run(
        cmd, cwd=har.parent, capture_output=True, text=True, timeout=timeout, check=False
    )


def responses_of(har: Path) -> list[tuple[str, int, str, str]]:
    """(path, status, content type, body) of every exchange in a HAR report."""
    out = []
    for e in json.loads(har.read_text())["log"]["entries"]:
        content = e["response"].get("content", {})
        out.append(
            (
                httpx.URL(e["request"]["url"]).path,
                e["response"]["status"],
                content.get("mimeType", ""),
                content.get("text", "") or "",
            )
        )
    return out


def leaks_in(exchanges: list[tuple[str, int, str, str]]) -> list[tuple[str, int, str]]:
    """Error bodies, /health bodies and streamed error events that reveal internals."""
    bad = []
    for path, status, ctype, body in exchanges:
        if status >= 400 or path == "/health":
            texts = [body]
        elif ctype.startswith("text/event-stream"):
            texts = [ln for ln in body.splitlines() if '"error"' in ln]
        else:
            continue
        bad += [(path, status, t[:300]) for t in texts if LEAKS.search(t)]
    return bad
