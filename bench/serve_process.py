"""Start the real `moe-offload serve` as a subprocess on a free loopback port: for the tests
(tests/server_fixtures.py), bench/fuzz_release.py and bench/prefix_cache_bench.py."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} from /metrics, parsed by prometheus_client."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def engine_pid(self) -> int | None:
        """The running engine: a child of the server's forkserver (server/engine_spawn.py), or
        with --no-engine-preload a child of the server itself (spawn_main). The other children are
        multiprocessing's resource tracker; a dead engine not yet reaped is skipped."""
        for kid in _children(self.proc.pid):
            cmd = _cmdline(kid)
            if b"spawn_main" in cmd:
                return kid
            if b"forkserver" in cmd:
                live = [k for k in _children(kid) if _state(k) not in (None, "Z")]
                if live:
                    return live[0]
        return None


def server_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser with `doc` as its description and the --model flag of every benchmark
    that starts a server (default: the embedded model)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=str(REPO / "models" / "embedded" / "target"),
        help="model directory (default: the embedded model)",
    )
    return ap


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...); None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@contextmanager
def serve(
    args: list[str],
    log_path: Path,
    ready_timeout: float = 90.0,
    enter: Callable[[], None] | None = None,
) -> Iterator[RunningServer]:
    """Yield a ready server; its own process group, so a test can SIGTERM the whole group. `enter`: run in
    the server's process before it starts (bench/cgroup.py's MemoryCgroup.enter puts it in a cgroup)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        *args,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=enter,
        )
    srv = RunningServer(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log()}")
            try:
                if httpx.get(srv.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {ready_timeout} s:\n{srv.log()}")
            time.sleep(0.2)
        yield srv
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
