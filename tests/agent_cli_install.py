"""Install the agent CLIs pinned in tests/agent_clis.txt into .cache/agent-clis from the npm registry.

tests/test_agent_clients.py calls `install()` on first use, so the README's test command works on a fresh
machine; .ci/run also starts this file (`python3 tests/agent_cli_install.py`) in the background while it
installs the Python packages, so the download overlaps them. One installer at a time, across processes
(a file lock): a second caller waits, then finds them installed. Standard library only."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLIS = REPO / ".cache" / "agent-clis"
BIN = CLIS / "node_modules" / ".bin"
PINNED = (REPO / "tests" / "agent_clis.txt").read_text().split()


def _ok() -> bool:
    stamp = CLIS / "installed.txt"
    have = all((BIN / n).exists() for n in ("claude", "codex")) and stamp.exists()
    return have and stamp.read_text().split() == PINNED


def install() -> str | None:
    """Install the pinned CLIs unless they are there; None when done, else what went wrong (one message)."""
    if _ok():
        return None
    npm = shutil.which("npm")
    if npm is None:
        return "the agent-client tests need npm (Node.js) to install the CLIs: apt-get install npm"
    CLIS.mkdir(parents=True, exist_ok=True)
    with open(CLIS.parent / "agent-clis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ok():  # another process installed them while this one waited
            return None
        npm_args = ["install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(CLIS)]
        res = subprocess.run([npm, *npm_args, *PINNED], capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            return f"npm install {' '.join(PINNED)} failed: {res.stderr.strip()[-2000:]}"
        (CLIS / "installed.txt").write_text("\n".join(PINNED) + "\n")
    return None


if __name__ == "__main__":
    problem = install()
    if problem:
        print(f"agent_cli_install: {problem}", file=sys.stderr)
    sys.exit(1 if problem else 0)
