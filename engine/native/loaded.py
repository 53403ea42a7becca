"""Which native kernels an op runs: the build of the engine whose model runs it, or none.

A load resolves its engine's choice once (`resolve_native_kernels`: --native-kernels auto/on/off,
--native-build, --native-build-limit: the widest build this CPU runs, never one chosen by timing, so every
load of a model on one machine computes the same bits) into a `NativeChoice`, which the loaded model holds. The model
makes it the active one around everything that runs its tensors (the load, its runner's steps and
forwards: `active`), so two engines in one process each run their own kernels. `native()` is the
active choice's `NativeKernels` (engine/native/kernels.py), or None where they are unavailable (no
compiler) or turned off; callers then use torch. Where no model is active (a test of one kernel, a benchmark) it is the widest build this
CPU runs. `usable` and `row_gemv` say where an activation can take them.

A context variable, not a module flag: a thread sees the choice of the context it runs in. Pool
threads start with an empty one, so whoever hands them tensor work submits it in a copy of its own
(`contextvars.copy_context().run`, as engine/experts/compute/cpu_experts.py does).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from engine import env
from engine.errors import ConfigError
from engine.native.autotune import TORCH, measured
from engine.native.build import build, compiler, library_path
from engine.native.decode_shapes import NATIVE_OFF, DecodeShapes
from engine.native.kernels import X_CODES, NativeKernels
from engine.native.row_kernels import native_rows_allowed
from engine.native.row_ops import reads_weights
from engine.native.variants import by_name, runnable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NativeChoice:
    """One engine's native kernels: the build its ops run (None: torch's kernels) and the plan's line
    for it ("on: <build>; <measurement>" or "off: <why>")."""

    kernels: NativeKernels | None
    line: str


# The choice of the model whose tensors run in this context; None: no model's (the widest build).
_ACTIVE: ContextVar[NativeChoice | None] = ContextVar("native_choice", default=None)


def resolve_native_kernels(
    mode: str,
    shapes: DecodeShapes | None = None,
    build_name: str = "auto",
    build_limit: str = "auto",
) -> NativeChoice:
    """--native-kernels (auto, on, off), --native-build and --native-build-limit resolved for one engine:
    what runs and why: the build named, else the widest this CPU runs. `shapes`: the model's decode shapes,
    for the plan line's measurement of that build against torch's kernels (None: no measurement). `on` without the kernels (no compiler) fails with one line, and so
    does a build named that this CPU cannot run. Changes nothing: the caller makes the choice active."""
    if mode == "off":
        return NativeChoice(None, NATIVE_OFF)
    kernels, why = _widest_build(build_name, build_limit)
    if kernels is None:
        if mode == "on" or build_name != "auto":
            raise ConfigError(
                f"--native-kernels {mode} --native-build {build_name}: {why}; install gcc, or use --native-kernels off"
            )
        return NativeChoice(None, f"off: {why}")
    line = f"on: {kernels.describe()}"
    if shapes is None:
        return NativeChoice(kernels, line)
    ids = {kernels.variant: library_path(compiler() or "cc", by_name(kernels.variant)).name}
    m = measured(
        shapes, {kernels.variant: kernels}, ids, env.cache_root() / "native" / "autotune.json"
    )
    if m.chosen == TORCH:
        line += " (torch's kernels measured faster, but they sum a row in another order with other rows beside it: --native-kernels off runs them)"
    return NativeChoice(kernels, f"{line}; {m.line()}")


def probe(mode: str, shapes: DecodeShapes | None, build: str, limit: str) -> tuple[str | None, str]:
    """This CPU's answer to a load plan's question (engine/memory/machine.py `KernelProbe`): the build
    `resolve_native_kernels` chooses (None: torch's kernels) and its plan line, the build loaded (compiled
    once) and measured (cached per CPU and shape) here."""
    choice = resolve_native_kernels(mode, shapes, build, limit)
    return (choice.kernels.variant if choice.kernels else None), choice.line


def chosen(build_name: str | None, line: str) -> NativeChoice:
    """The choice a load plan recorded (engine/plan/load_plan.py KernelBuild): the build it named, loaded
    (once per process), with the plan's line; None: torch's kernels."""
    return NativeChoice(load_build(build_name)[0] if build_name is not None else None, line)


def _widest_build(build_name: str, limit: str) -> tuple[NativeKernels | None, str]:
    """The build an engine runs: the one named, else the widest this CPU runs (no wider than `limit`) that
    builds; or None and why. Never chosen by timing: builds differ in lane counts and dot products, so
    each computes its own bits, and a choice by measurement could give two loads of one model on one
    machine (another cache size, another load on the machine) two numeric families (issue 55)."""
    names = _build_names(build_name, limit)
    why = "no build of the native kernels runs on this CPU"
    for name in names:  # widest first; a build that fails to compile gives way to the next
        kernels, why = load_build(name)
        if kernels is not None:
            return kernels, ""
    return None, why


@contextmanager
def active(choice: NativeChoice | None) -> Iterator[None]:
    """Within the block, ops in this context run `choice`'s kernels; None leaves the caller's choice."""
    if choice is None:
        yield
        return
    token = _ACTIVE.set(choice)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def activate(choice: NativeChoice) -> None:
    """Make `choice` the active one for the rest of the current context: for a function that runs in its
    own copy of the caller's context (engine/worker/loader.py's load), so the caller's stays unchanged."""
    _ACTIVE.set(choice)


def _build_names(build_name: str, limit: str) -> list[str]:
    """The builds to try, widest first: the one named (refused in one line where this CPU lacks its
    instructions), else every build this CPU runs no wider than `limit`."""
    if build_name == "auto":
        return [v.name for v in runnable(limit=limit)]
    variant = by_name(build_name)
    if variant not in runnable():
        raise ConfigError(
            f"--native-build {build_name}: this CPU lacks {', '.join(variant.needs)}; use --native-build auto"
        )
    return [build_name]


def load_builds(build_name: str, limit: str = "auto") -> tuple[dict[str, NativeKernels], str]:
    """The builds this CPU runs, widest first, no wider than `limit` (or the one named), loaded; or none
    and why."""
    names = _build_names(build_name, limit)
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


@functools.cache
def widest() -> NativeChoice:
    """The choice where no model's is active (a test of one kernel, a benchmark): the widest build this
    CPU runs, or none (no compiler). Resolved once per process; it never changes."""
    return resolve_native_kernels("auto")


def native() -> NativeKernels | None:
    """The active model's native kernels (`active`), or None where it runs torch's; where no model's
    choice is active, the widest build this CPU runs."""
    choice = _ACTIVE.get()
    return (widest() if choice is None else choice).kernels


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
    if not reads_weights(w.dtype, x.dtype) or not w.is_contiguous() or w.shape[-1] != x.shape[-1]:
        return None  # (rows of another width fail on torch's path, as F.linear fails them)
    kernels = usable(x)
    return kernels.gemv(x, w) if kernels is not None else None
