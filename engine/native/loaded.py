"""The process's native kernels: built on first use, turned off by `--native-kernels off`.

`native()` is the process's one `NativeKernels` (engine/native/kernels.py), or None where the
kernels are unavailable (no compiler) or turned off (the loader applies `--native-kernels` with
`use_native_kernels`); callers then use torch. `usable` and `bf16_gemv` say where an activation
can take them.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.native.build import build
from engine.native.kernels import MAX_ROWS, X_CODES, NativeKernels
from engine.native.row_kernels import native_rows_allowed

log = logging.getLogger(__name__)


class _Choice:
    """EngineConfig.native_kernels as the last model loaded in this process set it: the library is one per
    process, and so is the choice (a process serves one model)."""

    enabled = True


def use_native_kernels(mode: str) -> str:
    """Apply --native-kernels (auto, on, off) to this process; returns what runs and why, for the engine's
    plan. `on` without the kernels (no compiler) fails with one line."""
    _Choice.enabled = mode != "off"
    if mode == "off":
        return "off: --native-kernels off (torch's kernels)"
    kernels, why = _load()
    if kernels is None:
        if mode == "on":
            from engine.errors import ConfigError

            raise ConfigError(
                f"--native-kernels on, but {why}; install gcc, or use --native-kernels auto"
            )
        return f"off: {why}"
    return f"on: {kernels.describe()}"


def native() -> NativeKernels | None:
    """The process's native kernels (built on first call), or None where unavailable or turned off."""
    return _load()[0] if _Choice.enabled else None


@functools.lru_cache(maxsize=1)
def _load() -> tuple[NativeKernels | None, str]:
    """The kernels, built once, or None and why, said once, where unavailable."""
    lib, why = build()
    if lib is None:
        log.warning(why)
        return None, why
    kernels = NativeKernels(lib)
    log.info(kernels.describe())
    return kernels, ""


def usable(x: torch.Tensor) -> NativeKernels | None:
    """The kernels, where they can take activation x: on the CPU, a dtype they read, few rows, contiguous,
    in a step whose rows take them (engine/native/row_kernels.py)."""
    if (
        not native_rows_allowed()
        or x.device.type != "cpu"
        or x.dtype not in X_CODES
        or x.dim() != 2
        or not 1 <= x.shape[0] <= MAX_ROWS
        or not x.is_contiguous()
    ):
        return None
    return native()


def bf16_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [m, in] times a bf16 weight w [out, in] through the native kernel where it applies (both bf16,
    x on the CPU with few contiguous rows, w contiguous), else None: the caller keeps torch's path."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not w.is_contiguous():
        return None
    kernels = usable(x)
    return kernels.gemv(x, w) if kernels is not None else None
