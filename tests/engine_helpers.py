"""Small helpers shared by the engine tests."""

from __future__ import annotations

import time


def settle(om, seconds: float = 10.0) -> None:
    """Let transfers still in flight land: a load that was started keeps its slot pinned until it
    lands, even when the step that asked for it failed or finished. Only then is a leftover pin a leak."""
    deadline = time.monotonic() + seconds
    while om.transfers.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
