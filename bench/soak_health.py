"""The soak's /health probe, in a process of its own: what /health's latency is at the server.

Measured from a thread of the soak's client process, /health's latency also holds the time that
thread waits for the GIL of a process whose client threads parse SDK streams without pause: in one
90 s soak on the 2-core machine, p99 83 ms measured in-process against 55 ms from a separate
process, at the same moments. So the sampler (bench/soak_monitor.py) reads /health's latency and
status from this process, which does nothing else.

    python -m bench.soak_health URL PERIOD   # a line per probe: "<monotonic s> <ms or -1> <status>"
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx

from bench.serve_process import REPO


def probe(hc: httpx.Client, url: str) -> tuple[float | None, str]:
    """(milliseconds, status) of one GET /health; (None, the error's name) without an answer in 5 s."""
    t = time.perf_counter()
    try:
        r = hc.get(url + "/health", timeout=5)
    except httpx.HTTPError as e:
        return None, type(e).__name__
    return (time.perf_counter() - t) * 1000, str(r.json().get("status", r.status_code))


class HealthProbe:
    """Runs this module in a child process; `readings` holds every probe as (monotonic seconds at
    its start, ms or None, status), `latest()` the last one. (CLOCK_MONOTONIC is the machine's, so
    the child's times compare with this process's.)"""

    def __init__(self, url: str, period: float) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.soak_health", url, str(period)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.readings: list[tuple[float, float | None, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name="soak-health")
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            t, ms, status = line.split(maxsplit=2)
            self.readings.append((float(t), None if float(ms) < 0 else float(ms), status.strip()))

    def latest(self) -> tuple[float | None, str]:
        return self.readings[-1][1:] if self.readings else (None, "no probe yet")

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)
        self._reader.join(5)


def probe_loop() -> int:
    """The child process: probe every PERIOD s and print each reading, until terminated."""
    url, period = sys.argv[1], float(sys.argv[2])
    with httpx.Client() as hc:
        while True:
            t = time.monotonic()
            ms, status = probe(hc, url)
            print(f"{t:.3f} {-1.0 if ms is None else ms:.3f} {status}", flush=True)
            time.sleep(period)


if __name__ == "__main__":
    raise SystemExit(probe_loop())
