"""The soak's resource faults: a memory cgroup shrunk under load, and a full disk for the quant cache.

Memory (`--memory-fault-every S`): the server (front end, forkserver, engine) runs in a memory
cgroup of its own (bench/cgroup.py; root, cgroup v1 or v2), entered before it executes. Every S s
its limit drops to the anonymous memory its processes hold now plus MEMORY_HEADROOM (cgroup v1
refuses a limit it cannot reclaim down to: the tightest it accepts), and PRESSURE_REQUESTS
context-filling prompts arrive: the kernel reclaims the page cache, and what the prefill then
allocates beyond the limit makes the OOM killer act inside the group. After HOLD_S s the limit
is lifted. Counted: the OOM kills in the group, whether the front end (which
holds every client's connection) survived, and how long until /health says ready again.

Disk (`--disk-full-every S`): the server runs with `--expert-quant int8` and its quantized-expert
cache (engine/experts/formats/quant_cache.py) on a small tmpfs of its own (root: mount). The cache is
written only when an engine starts, so the fault is what an operator meets after a disk filled up
and a cache cleaner ran: the sidecar is removed, the tmpfs filled to the last byte, and the engine
SIGKILLed; its restarts cannot write the sidecar (ENOSPC) until, HOLD_S s later, the filler is
removed. Counted: the failed engine starts, and how long until /health says ready again.

Every fault (and bench/soak_monitor.py's SIGKILLs) takes FAULT_LOCK for its whole course, so two
never overlap and each request cut by one is counted against it (bench/soak_summary.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.cgroup import MemoryCgroup
from bench.serve_process import RunningServer
from bench.soak_health import probe
from bench.soak_outcomes import Clock

HOLD_S = 10.0  # how long a shrunk limit or a full disk lasts
DISK_HOLD_MAX_S = 60.0  # a full disk lasts until an engine start failed on it, at most this long
MEMORY_HEADROOM = 0  # bytes above the anonymous memory: the tightest limit the kernel accepts
READY_WAIT_S = 90.0  # after the fault is lifted, how long to wait for /health to say ready
PRESSURE_REQUESTS = 4  # context-filling prompts sent while a shrunk limit holds
# The quant cache's tmpfs (the embedded model's int8 sidecar is about 5 MiB).
QUANT_TMPFS_BYTES = 64 * 2**20
UNLIMITED = 2**62  # a cgroup limit that never binds
# One fault at a time: a SIGKILL, a shrunk cgroup or a full disk runs its course under this lock.
FAULT_LOCK = threading.Lock()


@dataclass
class FaultEvent:
    kind: str  # memory_cgroup | disk_full
    t: float  # when it began (soak seconds)
    lifted: float | None = None  # when the limit was lifted / the disk freed (soak seconds)
    serving_s: float | None = (
        None  # from `t` until /health said ready after it; None: not within READY_WAIT_S
    )
    detail: dict[str, Any] = field(default_factory=dict)


def _wait_ready(hc: httpx.Client, url: str, clock: Clock, t0: float) -> float | None:
    """Seconds from soak time t0 until /health says ready (None: not within READY_WAIT_S)."""
    while clock.now() - t0 < READY_WAIT_S + HOLD_S:
        if probe(hc, url)[1] == "ready":
            return clock.now() - t0
        time.sleep(0.1)
    return None


class MemoryFault:
    """The server's memory cgroup, and its shrinking. The server starts inside it (`enter` runs
    in its process before exec), so every page it and its children touch is charged there."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        why = MemoryCgroup.unavailable()
        if why is not None:
            raise SystemExit(f"--memory-fault-every: {why}")
        self.cg = MemoryCgroup(UNLIMITED, name=f"moe-offload-soak-{os.getpid()}")
        self.enter = self.cg.enter  # serve()'s `enter`: in the server's process, before exec
        self.srv: RunningServer | None = None

    def run(self, clock: Clock, hc: httpx.Client) -> FaultEvent:
        assert self.srv is not None, "attach the running server first"
        ev = FaultEvent("memory_cgroup", clock.now())
        front = self.srv.proc.pid
        kills0, engine0 = self.cg.oom_kills(), self.srv.engine_pid()
        usage = self.cg.usage()
        limit = self.cg.anon() + MEMORY_HEADROOM
        while True:  # v1 refuses a limit it cannot reclaim down to: step up until it takes
            try:
                self.cg.set_limit(limit)
                break
            except OSError:
                limit += 4 * 2**20
        ev.detail = {"usage_mib": round(usage / 2**20, 1), "limit_mib": round(limit / 2**20, 1)}
        ev.detail["pressure"] = self._pressure(clock.now() + HOLD_S)
        time.sleep(max(0.0, ev.t + HOLD_S - clock.now()))
        self.cg.set_limit(UNLIMITED)
        ev.lifted = clock.now()
        ev.serving_s = _wait_ready(hc, self.srv.base_url, clock, ev.t)
        ev.detail |= {
            "oom_kills": self.cg.oom_kills() - kills0,
            "front_end_survived": self.srv.proc.poll() is None and psutil.pid_exists(front),
            "engine_replaced": self.srv.engine_pid() != engine0,
        }
        return ev

    def _pressure(self, until: float) -> dict[str, int]:
        """While the limit holds, PRESSURE_REQUESTS completions at once whose prompts fill the
        context (token ids), so the engine's prefill allocates what the limit no longer has;
        {HTTP status or error name: count} of their answers."""
        assert self.srv is not None
        body = {"model": "soak", "prompt": [7] * (self.max_model_len - 8), "max_tokens": 4}

        def one(_: int) -> str:
            try:
                r = httpx.post(
                    self.srv.base_url + "/v1/completions", json=body, timeout=READY_WAIT_S
                )  # type: ignore[union-attr]
                return str(r.status_code)
            except httpx.HTTPError as e:
                return type(e).__name__

        with ThreadPoolExecutor(PRESSURE_REQUESTS) as pool:
            got = list(pool.map(one, range(PRESSURE_REQUESTS)))
        return dict(Counter(got))

    def close(self) -> None:
        self.cg.close()


def _failed_starts(log: str) -> int:
    """Engine starts that failed for want of space, by the front end's log line for each."""
    return len(re.findall(r"engine died: model load failed: .*No space left on device", log))


class DiskFault:
    """A small tmpfs for the quant cache, and filling it."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="soak-quant-"))
        size = f"size={QUANT_TMPFS_BYTES}"
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(self.dir)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            self.dir.rmdir()
            raise SystemExit(f"--disk-full-every: cannot mount a tmpfs (root needed): {r.stderr}")

    def server_args(self) -> list[str]:
        return ["--expert-quant", "int8", "--quant-cache-dir", str(self.dir)]

    def _fill(self, name: str = "filler") -> None:
        with open(self.dir / name, "wb") as f:
            chunk = b"\0" * 2**20
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass  # ENOSPC: full
            try:  # the last partial chunk, byte by byte in halves
                for n in (2**k for k in range(19, -1, -1)):
                    f.write(chunk[:n])
                    f.flush()
            except OSError:
                pass

    def run(self, srv: RunningServer, clock: Clock, hc: httpx.Client) -> FaultEvent:
        ev = FaultEvent("disk_full", clock.now())
        log0 = _failed_starts(srv.log_path.read_text(errors="replace"))
        for f in self.dir.glob("*.safetensors"):
            f.unlink()
        self._fill()
        pid = srv.engine_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        # The killed engine held the removed sidecar open (a disk tier reads it): its blocks come
        # free when the process is gone, so the disk is topped up again and again while it holds.
        # It holds HOLD_S, and longer (at most DISK_HOLD_MAX_S) until an engine start has met it:
        # the supervisor's backoff may put the first restart after HOLD_S.
        n, failed = 0, False
        while clock.now() < ev.t + HOLD_S or (not failed and clock.now() < ev.t + DISK_HOLD_MAX_S):
            n += 1
            self._fill(f"filler{n}")
            time.sleep(0.02)
            if n % 25 == 0:
                failed = _failed_starts(srv.log_path.read_text(errors="replace")) > log0
        for f in self.dir.glob("filler*"):
            f.unlink()
        ev.lifted = clock.now()
        ev.serving_s = _wait_ready(hc, srv.base_url, clock, ev.t)
        text = srv.log_path.read_text(errors="replace")
        ev.detail = {
            "failed_starts": _failed_starts(text) - log0,
            "server_alive": srv.proc.poll() is None,
        }
        return ev

    def close(self) -> None:
        subprocess.run(["umount", str(self.dir)], capture_output=True)
        self.dir.rmdir()


class FaultSchedule:
    """A thread that runs each fault every `every` s (first at `offset` s), none after `last` s."""

    def __init__(self, clock: Clock, url: str, last: float) -> None:
        self.clock, self.url, self.last = clock, url, last
        self.events: list[FaultEvent] = []
        self._stop = threading.Event()
        self._jobs: list[tuple[float, float, Callable[[httpx.Client], FaultEvent]]] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-faults")

    def add(self, every: float, offset: float, job: Callable[[httpx.Client], FaultEvent]) -> None:
        self._jobs.append((every, offset, job))

    def start(self) -> None:
        if self._jobs:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(READY_WAIT_S + 2 * HOLD_S)

    def _run(self) -> None:
        due = [offset for _, offset, _ in self._jobs]
        with httpx.Client() as hc:
            while not self._stop.wait(0.2):
                now = self.clock.now()
                if self.clock.draining or now > self.last:
                    return
                for i, (every, _, job) in enumerate(self._jobs):
                    if now >= due[i]:
                        due[i] += every
                        with FAULT_LOCK:
                            self.events.append(job(hc))

    def as_list(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]
