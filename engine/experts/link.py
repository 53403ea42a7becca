"""An emulated link in front of the slow tier, to study links we do not have.

The link is a single serial pipe: each transfer occupies it for nbytes/bandwidth,
transfers queue behind each other, and each pays a fixed latency on top. The real
read runs concurrently, so the emulated time is a floor: if the real medium is slower
than the emulated link, the real time wins.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from engine.errors import ConfigError

# Named links: (MB/s, latency µs). Rough public figures for each medium.
NAMED_LINKS: dict[str, tuple[float, float]] = {
    "pcie4": (25_000.0, 10.0),
    "pcie3": (12_000.0, 10.0),
    "nvme": (3_000.0, 80.0),
    "sata-ssd": (500.0, 100.0),
    "ufs": (1_000.0, 150.0),
    "usb3": (300.0, 300.0),
    "sdcard": (80.0, 1_000.0),
    "hdd": (150.0, 8_000.0),
}


@dataclass(frozen=True)
class LinkSpec:
    name: str
    mb_per_s: float
    latency_us: float

    def seconds_for(self, nbytes: int) -> float:
        return nbytes / (self.mb_per_s * 1e6) + self.latency_us * 1e-6


def parse_link(text: str) -> LinkSpec:
    """Accept a name from NAMED_LINKS or 'MBPS[:LATENCY_US]', e.g. '200:500' or '200MB/s,500us'."""
    key = text.strip().lower()
    if key in NAMED_LINKS:
        bw, lat = NAMED_LINKS[key]
        return LinkSpec(key, bw, lat)
    m = re.fullmatch(r"([\d.]+)\s*(?:mb/s)?\s*(?:[:,]\s*([\d.]+)\s*(?:us)?)?", key)
    if not m:
        raise ConfigError(
            f"bad --link {text!r}: use a name ({', '.join(NAMED_LINKS)}) or MBPS[:LATENCY_US], e.g. 200:500"
        )
    bw, lat = float(m.group(1)), float(m.group(2) or 0.0)
    if bw <= 0:
        raise ConfigError(f"bad --link {text!r}: bandwidth must be > 0 MB/s")
    return LinkSpec(f"{bw:g}MB/s+{lat:g}us", bw, lat)


class EmulatedLink:
    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._free_at = 0.0  # monotonic time at which the pipe is next idle
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Book the pipe for one transfer; returns the monotonic time it completes."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / (self.spec.mb_per_s * 1e6)
            return self._free_at + self.spec.latency_us * 1e-6

    @staticmethod
    def wait_until(deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)
