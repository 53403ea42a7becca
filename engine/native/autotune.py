"""Which native build runs, and whether the native kernels run at all: measured on this CPU.

A capability list says what a CPU can execute, not what is fast on it: on an AMD EPYC with AVX2
only, the native kernels of the time (fast paths for AVX-512 only) decoded at half of torch's speed,
and the plan still chose them. So at load the engine times, for this model's decode shapes and
dtype (the experts' weights in the dtype each path holds them in), a single-row matrix-vector product
through each build its CPU runs
(engine/native/variants.py) and through torch's F.linear, at one thread, interleaved, best of a few
rounds, over weights larger than the caches (a decode step streams its weights from memory), in
thread CPU time (a shared machine's other work then costs a candidate bandwidth, not the seconds it
was descheduled). The fastest wins; the native kernels run only where their best build beats torch.
The result is cached per CPU (model name and flags), torch version, source, shapes and dtype, in
`<cache>/native/autotune.json`, so a later start reads it instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.native.decode_shapes import DecodeShapes
from engine.native.variants import cpu_flags, cpu_model

if TYPE_CHECKING:
    from engine.native.kernels import NativeKernels

log = logging.getLogger(__name__)
TORCH = "torch"
STREAM_BYTES = 48 << 20  # weights cycled per shape: past the last-level cache of common CPUs
MAX_COPIES = (
    64  # ... but at most this many matrices: a small model's weights stay in cache when it runs too
)
ROUNDS = 4
TIE = 0.95  # within 5 %: the earlier candidate (the widest build, then any build before torch)


@dataclass(frozen=True)
class Measurement:
    # candidate (a build's name or "torch") -> weight bytes streamed per second / 1e9
    gbps: dict[str, float]
    chosen: str  # the fastest candidate
    cached: bool = False
    layer_ms: dict[str, float] | None = (
        None  # candidate -> estimated ms a decode layer (see measure)
    )

    def line(self) -> str:
        figures = ", ".join(
            f"{name} {g:.1f}" for name, g in sorted(self.gbps.items(), key=lambda kv: -kv[1])
        )
        per_layer = (
            "; estimated ms a decode layer: "
            + ", ".join(
                f"{n} {t:.2f}" for n, t in sorted(self.layer_ms.items(), key=lambda kv: kv[1])
            )
            if self.layer_ms
            else ""
        )
        return f"measured GB/s at this model's decode shapes: {figures}{per_layer}" + (
            " (cached)" if self.cached else ""
        )


def _time(fn: Callable[[], object]) -> float:
    """The calling thread's CPU seconds for one call of `fn`, after a warm-up call. CPU time, not wall
    time: on a shared machine a candidate descheduled for a moment would otherwise lose for good (the
    result is cached). One thread (measure sets it), so the kernels run in this thread."""
    fn()  # warm: first touch of scratch, the library's first call
    t0 = time.thread_time()
    fn()
    return max(time.thread_time() - t0, 1e-9)


def measure(shapes: DecodeShapes, builds: Mapping[str, NativeKernels]) -> Measurement:
    """Time every build in `builds` and torch on `shapes`; returns GB/s per candidate and the fastest.
    A build streams the weights in one native call (gemv_sweep: a fused decode step pays no call per
    matrix either); torch runs F.linear per matrix from Python, as its layer-by-layer path does. Ties
    within 5 % (TIE) go to the native build listed first (the widest), and between the best build and
    torch to the build."""
    dtype = getattr(torch, shapes.dtype)
    xs = [torch.full((1, cols), 0.5, dtype=dtype) for _, cols in shapes.mats]
    native_w, native_bytes = _matrices(shapes.mats, _dtypes(shapes, native=True))
    torch_w, torch_bytes = (
        _matrices(shapes.mats, _dtypes(shapes, native=False))
        if shapes.expert_dtype
        else (native_w, native_bytes)
    )

    def native_sweep(k: NativeKernels) -> Callable[[], object]:
        def sweep() -> None:
            for ws, x in zip(native_w, xs, strict=True):
                k.gemv_sweep(x, ws)

        return sweep

    def torch_sweep() -> None:
        for ws, x in zip(torch_w, xs, strict=True):
            for w in ws:
                F.linear(x, w)

    candidates: dict[str, Callable[[], object]] = {n: native_sweep(k) for n, k in builds.items()}
    candidates[TORCH] = torch_sweep
    per: dict[str, list[float]] = {name: [] for name in candidates}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # which build streams fastest is a property of one core's instructions
    try:
        for _ in range(
            ROUNDS
        ):  # interleaved rounds: a burst of load elsewhere hits every candidate
            for name, fn in candidates.items():
                nbytes = torch_bytes if name == TORCH else native_bytes
                per[name].append(nbytes / _time(fn) / 1e9)
    finally:
        torch.set_num_threads(threads)
    gbps = {name: max(v) for name, v in per.items()}
    # A decode layer, per candidate: its weight bytes at the candidate's speed, plus, for torch's
    # layer-by-layer path, the measured cost of one small torch call times the calls it makes besides
    # the matmuls; the native path runs the layer in one call (the fused forward).
    op_s = _small_op_seconds(shapes.mats[-1][1], dtype)
    layer_ms = {n: shapes.layer_bytes(n != TORCH) / (g * 1e9) * 1e3 for n, g in gbps.items()}
    layer_ms[TORCH] += shapes.torch_ops_per_layer() * op_s * 1e3
    best_native = min((layer_ms[n] for n in builds), default=float("inf"))
    native_first = [n for n in builds if layer_ms[n] * TIE <= best_native]
    chosen = native_first[0] if native_first and best_native * TIE <= layer_ms[TORCH] else TORCH
    return Measurement(gbps, chosen, layer_ms=layer_ms)


def _dtypes(shapes: DecodeShapes, native: bool) -> list[torch.dtype]:
    """torch's dtypes of `shapes`' matrices as the native kernels (`native`) or torch's path hold them."""
    return [getattr(torch, name) for name in shapes.weight_dtypes(native)]


def _matrices(
    mats: tuple[tuple[int, int], ...], dtypes: list[torch.dtype]
) -> tuple[list[list[torch.Tensor]], int]:
    """For each [rows, cols] of `mats`, in its dtype, enough copies to stream STREAM_BYTES (at most
    MAX_COPIES); and the bytes of them all."""
    weights: list[list[torch.Tensor]] = []
    nbytes = 0
    for (rows, cols), dtype in zip(mats, dtypes, strict=True):
        one = rows * cols * torch.finfo(dtype).bits // 8
        copies = min(MAX_COPIES, max(2, -(-STREAM_BYTES // one)))
        # Weights' values do not change the speed (no denormals): one buffer, viewed as `copies` matrices.
        buf = torch.full((copies * rows * cols,), 0.01, dtype=dtype)
        weights.append(
            [buf[i * rows * cols : (i + 1) * rows * cols].view(rows, cols) for i in range(copies)]
        )
        nbytes += one * copies
    return weights, nbytes


def _small_op_seconds(n: int, dtype: torch.dtype) -> float:
    """Thread CPU seconds of one small torch call (an add of two [1, n] rows): what each of the
    layer-by-layer path's non-matmul calls costs, dispatch and Python included."""
    a = torch.ones(1, n, dtype=dtype)
    calls = 400

    def run() -> None:
        for _ in range(calls):
            torch.add(a, a)

    return min(_time(run) for _ in range(3)) / calls


def _key(shapes: DecodeShapes, builds: Mapping[str, str]) -> str:
    """The cache key: what makes a measurement valid on another start."""
    parts = [
        cpu_model(),
        " ".join(sorted(cpu_flags())),
        torch.__version__,
        json.dumps(asdict(shapes)),
        json.dumps(dict(sorted(builds.items()))),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def measured(
    shapes: DecodeShapes, builds: Mapping[str, NativeKernels], ids: Mapping[str, str], cache: Path
) -> Measurement:
    """The measurement for `shapes`, from `cache` (a JSON file) when it holds one for this CPU and these
    builds (`ids`: each build's library file name, which carries its source hash), else measured now and
    stored."""
    key = _key(shapes, ids)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    hit = known.get(key)
    if isinstance(hit, dict) and set(hit.get("gbps", {})) == {*builds, TORCH}:
        return Measurement(
            dict(hit["gbps"]), str(hit["chosen"]), cached=True, layer_ms=hit.get("layer_ms")
        )
    m = measure(shapes, builds)
    known[key] = {"gbps": m.gbps, "chosen": m.chosen, "layer_ms": m.layer_ms}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(
            tmp, cache
        )  # whole-file replace: a concurrent start reads the old or the new file
    except OSError as e:
        log.warning("could not cache the kernel measurement in %s: %s", cache, e)
    return m
