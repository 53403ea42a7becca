"""`--device-memory` / `--host-memory` values: BYTES (1234, 24GiB, 24G, 512MiB) or a FRACTION of
what the machine has free (0.8, 80%)."""

from __future__ import annotations

import re

from engine.errors import ConfigError

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_budget(text: str, flag: str) -> tuple[int | None, float | None]:
    """(bytes, None) or (None, fraction) for a budget string; ConfigError with one line when malformed."""
    s = text.strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)%", s)
    if m:
        frac = float(m.group(1)) / 100
        if not 0 < frac <= 1:
            raise ConfigError(f"{flag} {text!r}: a percentage must be in (0, 100]")
        return None, frac
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g|t|ki|mi|gi|ti)?b?", s)
    if not m:
        raise ConfigError(
            f"{flag} {text!r}: use bytes (e.g. 24GiB, 512MiB, 2000000000) or a fraction (0.8 or 80%)"
        )
    value, unit = float(m.group(1)), m.group(2) or ""
    if not unit and value <= 1.0 and "." in m.group(1):
        if value <= 0:
            raise ConfigError(f"{flag} {text!r}: a fraction must be in (0, 1]")
        return None, value
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{flag} {text!r}: must be > 0")
    return n, None


def is_fraction(text: str) -> bool:
    """Whether a budget's text is a share of what is measured ("0.8", "80%") rather than a size."""
    return parse_budget(text, "")[1] is not None


def resolve_budget(text: str | None, flag: str, measured: int) -> int:
    """The budget in bytes: given bytes as they are, a fraction of `measured`, or `measured` when unset."""
    if text is None:
        return measured
    n, frac = parse_budget(text, flag)
    return n if n is not None else int(measured * (frac or 1.0))


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as the plan table prints them."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"
