"""An emulated link in front of the slow tier, to study links we do not have.

The link is a single serial pipe: each transfer occupies it for nbytes/bandwidth,
transfers queue behind each other, and each pays a fixed latency on top. The real
read runs concurrently, so the emulated time is a floor: if the real medium is slower
than the emulated link, the real time wins.
"""

from __future__ import annotations

import threading
import time

from engine.link_spec import (  # re-exported: config parses --link too
    NAMED_LINKS,
    LinkSpec,
    parse_link,
)

__all__ = ["NAMED_LINKS", "EmulatedLink", "LinkSpec", "parse_link"]


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
