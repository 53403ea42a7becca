"""The process's native kernels: which build runs (measured), or none.

`native()` is the process's one `NativeKernels` (engine/native/kernels.py), or None where the
kernels are unavailable (no compiler), turned off (`--native-kernels off`), or measured slower than
torch's here (engine/native/autotune.py); callers then use torch. The loader applies the engine's
choice with `use_native_kernels` once per load. `usable` and `row_gemv` say where an activation can
take them.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from engine import env
from engine.errors import ConfigError
from engine.native.autotune import DecodeShapes, measured
from engine.native.build import build, compiler, library_path
from engine.native.kernels import X_CODES, NativeKernels
from engine.native.row_kernels import native_rows_allowed
from engine.native.row_ops import reads_weights
from engine.native.variants import by_name, runnable

log = logging.getLogger(__name__)


class _Choice:
    """EngineConfig.native_kernels and native_build as the last model loaded in this process set them: the
    library is one per process, and so is the choice (a process serves one model)."""

    kernels: NativeKernels | None = None
    enabled = False
    resolved = False


def use_native_kernels(
    mode: str,
    shapes: DecodeShapes | None = None,
    build_name: str = "auto",
    build_limit: str = "auto",
) -> str:
    """Apply --native-kernels (auto, on, off), --native-build and --native-build-limit to this process;
    returns what runs and why, for the engine's plan. `shapes`: the model's decode shapes, for the
    measurement (None: no measurement, the widest build this CPU runs). `on` without the kernels (no
    compiler) fails with one line, and so does a build named that this CPU cannot run."""
    _Choice.resolved = True
    _Choice.enabled, _Choice.kernels = False, None
    if mode == "off":
        return "off: --native-kernels off (torch's kernels)"
    builds, why = _builds(build_name, build_limit)
    if not builds:
        if mode == "on" or build_name != "auto":
            raise ConfigError(
                f"--native-kernels {mode} --native-build {build_name}: {why}; install gcc, or use --native-kernels off"
            )
        return f"off: {why}"
    if shapes is None:
        name = next(iter(builds))
        _Choice.enabled, _Choice.kernels = True, builds[name]
        return f"on: {builds[name].describe()}"
    ids = {name: library_path(compiler() or "cc", by_name(name)).name for name in builds}
    m = measured(shapes, builds, ids, env.cache_root() / "native" / "autotune.json")
    native_best = max(builds, key=lambda n: m.gbps[n])
    if mode == "auto" and m.chosen == "torch":
        return f"off: torch's kernels measured fastest here; {m.line()}"
    name = m.chosen if m.chosen in builds else native_best
    _Choice.enabled, _Choice.kernels = True, builds[name]
    forced = " (--native-kernels on)" if m.chosen == "torch" else ""
    return f"on: {builds[name].describe()}{forced}; {m.line()}"


def _builds(build_name: str, limit: str = "auto") -> tuple[dict[str, NativeKernels], str]:
    """The builds this CPU runs, widest first, no wider than `limit` (or the one named), loaded; or none
    and why."""
    if build_name != "auto":
        variant = by_name(build_name)
        if variant not in runnable():
            raise ConfigError(
                f"--native-build {build_name}: this CPU lacks {', '.join(variant.needs)}; use --native-build auto"
            )
        names = [build_name]
    else:
        names = [v.name for v in runnable(limit=limit)]
    out: dict[str, NativeKernels] = {}
    why = "no build of the native kernels runs on this CPU"
    with ThreadPoolExecutor(len(names)) as pool:  # first use: the compilers run side by side
        loaded = list(pool.map(load_build, names))
    for name, (k, reason) in zip(names, loaded, strict=True):
        if k is not None:
            out[name] = k
        else:
            why = reason
    return out, why


@functools.cache
def load_build(name: str) -> tuple[NativeKernels | None, str]:
    """Build `name` once per process; the kernels or None and why (said once)."""
    lib, why = build(by_name(name))
    if lib is None:
        log.warning(why)
        return None, why
    return NativeKernels(lib, name), ""


def native() -> NativeKernels | None:
    """The process's native kernels, or None where unavailable, turned off or measured slower. Before any
    load chose (a test of one kernel, a benchmark), the widest build this CPU runs."""
    if not _Choice.resolved:
        use_native_kernels("auto")
    return _Choice.kernels if _Choice.enabled else None


def usable(x: torch.Tensor) -> NativeKernels | None:
    """The kernels, where they can take activation x: rows [m, n] on the CPU, a dtype they read,
    contiguous, in a step whose rows take them (engine/native/row_kernels.py)."""
    if (
        not native_rows_allowed()
        or x.device.type != "cpu"
        or x.dtype not in X_CODES
        or x.dim() != 2
        or x.shape[0] < 1
        or not x.is_contiguous()
    ):
        return None
    return native()


def row_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [m, in] times a weight w [out, in] of x's dtype (f32 or bf16; or bf16 weights for f32 rows, widened
    as they are read) through the native kernel where it applies (x on the CPU, contiguous, in a step whose
    rows take the native kernels; w contiguous), else None: the caller keeps torch's path. Each row's
    result is the one a single row gets, whatever m and whatever the other rows are: a decode row, a
    verification window's and a prompt's rows compute alike (batch-invariant)."""
    if not reads_weights(w.dtype, x.dtype) or not w.is_contiguous():
        return None
    kernels = usable(x)
    return kernels.gemv(x, w) if kernels is not None else None
