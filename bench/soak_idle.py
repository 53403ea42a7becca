"""The soak's idle check: when the load stops, the KV pool and the experts' fast tier go back to
the level they had before it began.

The soak reads /metrics once before its clients start and again near the end, after pausing the
clients and waiting until the server has no request running or waiting (an agent CLI's session
or a Schemathesis round finishes first). Compared: KV pool blocks in use (cached prefixes may
stay: they are reusable, not held) and the split of one budget between the KV pool and the
experts' slots (the engine gives borrowed slots back at idle, engine/memory/split.py).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.soak_monitor import metrics

IDLE_WAIT_S = 150.0  # the longest wait for the last requests to end (a CLI session, a round)
SETTLE_S = 2.0  # idle this long before the reading: the engine's idle step gives slots back


def read_levels(hc: httpx.Client, url: str) -> dict[str, Any] | None:
    """Requests running and waiting, KV blocks by state and the split, or None without /metrics."""
    try:
        m = metrics(hc, url)
    except httpx.HTTPError:
        return None
    keep = ("running", "waiting", "kv_blocks", "memory_split")
    return {k: m[k] for k in keep if k in m}


def _idle(levels: dict[str, Any] | None) -> bool:
    return levels is not None and levels.get("running") == 0 and levels.get("waiting") == 0


def wait_idle(hc: httpx.Client, url: str, limit: float = IDLE_WAIT_S) -> dict[str, Any]:
    """Wait until two readings SETTLE_S apart find no request running or waiting (at most
    `limit` s); the levels of the second, with the seconds waited and whether it got idle."""
    t0 = time.monotonic()
    levels = read_levels(hc, url)
    while time.monotonic() - t0 < limit:
        if _idle(levels):
            time.sleep(SETTLE_S)
            levels = read_levels(hc, url)
            if _idle(levels):
                break
        else:
            time.sleep(0.5)
            levels = read_levels(hc, url)
    return {"levels": levels, "waited_s": time.monotonic() - t0, "idle": _idle(levels)}


def back_to_idle(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """The comparison the page shows: KV blocks in use and the split, before and after."""
    got = after["levels"] or {}
    was = before or {}
    kv_before = (was.get("kv_blocks") or {}).get("in_use")
    kv_after = (got.get("kv_blocks") or {}).get("in_use")
    split_before, split_after = was.get("memory_split") or {}, got.get("memory_split") or {}
    return {
        "idle_reached": after["idle"],
        "waited_s": after["waited_s"],
        "kv_in_use": [kv_before, kv_after],
        "kv_cached_after": (got.get("kv_blocks") or {}).get("cached"),
        "memory_split": [split_before, split_after],
        "back": bool(
            after["idle"]
            and kv_before is not None
            and kv_after == kv_before
            and split_after == split_before
        ),
    }
