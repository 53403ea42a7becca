"""A link's description, parsed from --link: a named medium or MBPS[:LATENCY_US]. Plain data, so
the configuration can validate it without importing the engine's experts (engine/experts/tiers/link.py
emulates the link)."""

from __future__ import annotations

import re
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
