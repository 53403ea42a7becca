"""The soak's two background threads: a sampler of the server over time, and the fault schedule.

Sampler (every `period` s): the front end's RSS, open fds and threads (psutil), the engine
process's RSS, /health's latency and status (probed every `period` s from a process of its own,
bench/soak_health.py; every probe is kept), and from /metrics the engine's running and
waiting requests and its memory gauges (`moe_offload_memory_used_bytes` by kind).

Faults: SIGKILL of the engine process every `kill_every` s (the server's supervisor restarts
it); for each, the time until /health says ready again.  The SIGTERM drain at the end is
bench/soak.py's (it ends the run).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_process import RunningServer
from bench.soak_faults import FAULT_LOCK
from bench.soak_health import HealthProbe, probe
from bench.soak_outcomes import Clock


@dataclass
class Sample:
    t: float
    rss_mib: float | None  # the front end (the server process)
    fds: int | None
    threads: int | None
    engine_rss_mib: float | None
    health_ms: float | None  # None: /health did not answer within 5 s
    health: str
    running: float | None = None
    waiting: float | None = None
    memory_used: dict[str, float] = field(default_factory=dict)
    kv_blocks: dict[str, float] = field(default_factory=dict)  # in_use, cached, total
    memory_split: dict[str, float] = field(default_factory=dict)  # bytes: kv, experts


@dataclass
class Kill:
    t: float  # when the SIGKILL was sent (soak seconds)
    pid: int
    restart_s: float | None = None  # until /health said ready again; None: not within 60 s


# /metrics gauges a sample keeps by one label: {family: (sample field, label)}.
_LABELLED = {
    "moe_offload_memory_used_bytes": ("memory_used", "pool"),
    "moe_offload_kv_blocks": ("kv_blocks", "state"),
    "moe_offload_memory_split_bytes": ("memory_split", "part"),
}


def metrics(hc: httpx.Client, url: str) -> dict[str, Any]:
    """The sample's fields read from the server's /metrics."""
    out: dict[str, Any] = {name: {} for name, _ in _LABELLED.values()}
    for fam in text_string_to_metric_families(hc.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == "moe_offload_requests_running":
                out["running"] = s.value
            elif s.name == "moe_offload_requests_waiting":
                out["waiting"] = s.value
            elif s.name in _LABELLED:
                name, label = _LABELLED[s.name]
                out[name][s.labels.get(label, "all")] = s.value
    return out


class Monitor:
    """Starts both threads; `stop()` ends them; `samples` and `kills` hold what they saw."""

    def __init__(
        self,
        srv: RunningServer,
        clock: Clock,
        period: float,
        kill_every: float | None,
        last_kill: float = float("inf"),
        max_kills: int | None = None,
    ) -> None:
        self.srv, self.clock, self.period, self.kill_every = srv, clock, period, kill_every
        self.last_kill = last_kill  # no kill after this (soak seconds): its restart must finish
        self.max_kills = max_kills  # None: no limit
        self.samples: list[Sample] = []
        self.kills: list[Kill] = []
        self._stop = threading.Event()
        self._front = psutil.Process(srv.proc.pid)
        self._probe: HealthProbe | None = None
        self._threads = [threading.Thread(target=self._sample, daemon=True, name="soak-sampler")]
        if kill_every:
            self._threads.append(
                threading.Thread(target=self._fault, daemon=True, name="soak-kill")
            )

    def start(self) -> None:
        self._probe = HealthProbe(self.srv.base_url, self.period)
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(70)
        if self._probe is not None:
            self._probe.stop()

    def _proc(self) -> tuple[float | None, int | None, int | None, float | None]:
        try:
            rss = self._front.memory_info().rss / 2**20
            fds, threads = self._front.num_fds(), self._front.num_threads()
        except psutil.Error:
            return None, None, None, None
        pid = self.srv.engine_pid() if self.srv.proc.poll() is None else None
        try:
            eng = psutil.Process(pid).memory_info().rss / 2**20 if pid else None
        except psutil.Error:
            eng = None
        return rss, fds, threads, eng

    def _sample(self) -> None:
        with httpx.Client() as hc:
            while not self._stop.is_set():
                t = self.clock.now()
                assert self._probe is not None
                ms, status = self._probe.latest()
                try:
                    m = metrics(hc, self.srv.base_url)
                except httpx.HTTPError:
                    m = {}
                try:
                    proc = self._proc()
                except OSError:  # the server exited between the checks
                    proc = (None, None, None, None)
                self.samples.append(Sample(t, *proc, ms, status, **m))
                self._stop.wait(self.period)

    def _fault(self) -> None:
        assert self.kill_every
        with httpx.Client() as hc:
            while not self._stop.wait(self.kill_every):
                if self.clock.draining or self.clock.now() > self.last_kill:
                    return
                if self.max_kills is not None and len(self.kills) >= self.max_kills:
                    return
                with FAULT_LOCK:  # never during another fault (bench/soak_faults.py)
                    self._kill(hc)

    def _kill(self, hc: httpx.Client) -> None:
        pid = self.srv.engine_pid()
        if pid is None:
            return
        kill = Kill(self.clock.now(), pid)
        os.kill(pid, signal.SIGKILL)
        self.kills.append(kill)
        # The supervisor notices within its 0.1 s poll: wait until /health says so.
        while probe(hc, self.srv.base_url)[1] == "ready" and self.clock.now() - kill.t < 3:
            time.sleep(0.05)
        while self.clock.now() - kill.t < 60 and not self._stop.is_set():
            if probe(hc, self.srv.base_url)[1] == "ready":
                kill.restart_s = self.clock.now() - kill.t
                break
            time.sleep(0.1)

    def as_dict(self) -> dict[str, Any]:
        start = self.clock.start
        readings = self._probe.readings if self._probe is not None else []
        return {
            "samples": [asdict(s) for s in self.samples],
            "kills": [asdict(k) for k in self.kills],
            # Every /health probe: [soak seconds, ms or None, status].
            "health": [[t - start, ms, status] for t, ms, status in readings],
        }
