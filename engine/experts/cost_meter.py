"""Online costs for the workload balancer: copy time per expert, and per-expert compute time as
a function of its row count on the fast device and on the CPU path, as moving averages.

A linear fit t = a + b·rows is kept per device from exponentially weighted moments, so recent
measurements dominate (the machine's load and the link change while serving). Until a device
has been measured its fit is None, and the caller decides how to explore.
"""

from __future__ import annotations

import threading

RATE = 0.05  # weight of one new sample (about the last 20 samples matter)


class LinearFit:
    """Exponentially weighted least squares of t against rows."""

    def __init__(self, rate: float = RATE) -> None:
        self.rate = rate
        self.n = 0
        self._m = [0.0, 0.0, 0.0, 0.0]  # E[x], E[t], E[x²], E[x·t]

    def add(self, rows: int, seconds: float) -> None:
        r = 1.0 if self.n == 0 else self.rate
        for i, v in enumerate((rows, seconds, rows * rows, rows * seconds)):
            self._m[i] += r * (v - self._m[i])
        self.n += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) with t ≈ a + b·rows; b = 0 while the rows seen barely vary. None if unmeasured."""
        if self.n == 0:
            return None
        ex, et, exx, ext = self._m
        var = exx - ex * ex
        b = max(0.0, (ext - ex * et) / var) if var > 1e-6 else 0.0
        return max(0.0, et - b * ex), b


class CostMeter:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # CPU workers and transfer threads report concurrently
        self.fast = LinearFit()
        self.cpu = LinearFit()
        self.copy_seconds: float | None = None

    def record_copy(self, seconds: float) -> None:
        with self.lock:
            self.copy_seconds = (
                seconds
                if self.copy_seconds is None
                else self.copy_seconds + RATE * (seconds - self.copy_seconds)
            )

    def record_fast(self, rows: int, seconds: float) -> None:
        with self.lock:
            self.fast.add(rows, seconds)

    def record_cpu(self, rows: int, seconds: float) -> None:
        with self.lock:
            self.cpu.add(rows, seconds)
