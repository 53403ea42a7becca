"""Every environment variable the engine reads, in one place.

None of them changes what the engine computes or which path it takes: those choices are fields of
EngineConfig (engine/config.py), resolved once at load and logged. What remains here says where
files go and which compiler builds the native kernels, as any build tool reads them.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where the engine caches what it builds (native kernels, quantized experts).

    MOE_OFFLOAD_CACHE: the engine's own cache root (tests point it at a temporary directory);
    else XDG_CACHE_HOME/moe-offload, else ~/.cache/moe-offload (the XDG base directory rule)."""
    root = os.environ.get("MOE_OFFLOAD_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moe-offload"


def xdg_cache_root() -> Path:
    """XDG_CACHE_HOME/moe-offload (else ~/.cache/moe-offload), ignoring MOE_OFFLOAD_CACHE: the quantized
    experts' default place, documented as such in --quant-cache-dir's help."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moe-offload"


def c_compiler_override() -> str | None:
    """CC: the C compiler to build the native kernels with, tried before gcc and cc (as make does)."""
    return os.environ.get("CC") or None
