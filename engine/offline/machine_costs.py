"""The simulator's costs for this CPU box, from what the engine will run here (`plan --hardware measured`).

A hardware profile's costs for a CPU (configs/hardware/this-machine-disk.yaml) are fp32 GEMMs timed once,
on some earlier minute; the engine decodes with its native kernels (engine/native) in the model's dtype
and its experts in their stored format (bf16, or int8 with --expert-quant int8). So the costs here are:
- the dense part of a decode layer: the weight bytes a decode token streams (attention, norms, router,
  and the LM head spread over the layers; not the embedding table, which is only gathered from) at the
  GB/s the kernel dispatcher measured for this model's decode shapes and dtype (engine/native/autotune.py,
  the same measurement and per-CPU cache the engine's load reads), plus any per-layer overhead it measured
  for that candidate (torch's layer-by-layer path; none for the fused native path);
- one expert: the native expert kernel (moe_swiglu, one token through top-k experts, as a decode layer
  runs them) timed on this CPU for the expert format, cached beside the dispatcher's measurement;
- the link: expert transfers as a disk-tier worker makes them, measured now: the engine's own uncached
  reader (O_DIRECT) reading expert-sized ranges of the file the disk tier will read (the checkpoint, or
  the quantized sidecar where it exists) and the copy into a slot.
The kernels' figures are thread CPU time; on a shared machine the compute thread gets part of a core, so
the compute costs are divided by the share a busy thread got as the plan ran (core_share).
Each figure goes in `Costs.notes`, so the plan line says what it used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import env
from engine.offline.hardware import Costs
from engine.plan.probe import ExpertRead

STREAM_BYTES = 96 << 20  # expert weights cycled per timing: well past the last-level cache
ROUNDS = 4
DISK_SAMPLE_BYTES = 512 << 20  # bytes the link measurement reads (expert-sized reads, spread out)
DISK_READS_MIN = 32


@dataclass(frozen=True)
class KernelSpeeds:
    """What the dispatcher measured for the dense part, and the expert kernel's speed."""

    build: str  # the candidate the dispatcher chose ("torch" or a build's name)
    dense_gb_s: float
    dense_overhead_s: float  # per layer, beyond streaming (torch's small calls; 0 when native)
    expert_gb_s: float
    expert_cached: bool
    expert_kernel: str = "moe_swiglu"  # the native expert kernel timed: moe_swiglu or moe_mxfp4


def read_gb_s(reads: Sequence[ExpertRead], budget: int = DISK_SAMPLE_BYTES) -> tuple[float, int]:
    """(GB/s, transfers made) of expert transfers as a disk-tier worker makes them: the engine's
    uncached reader reads the range into its reusable buffer and the bytes are copied into a slot
    (slow_tier._pack), one transfer at a time in the order given, up to `budget` bytes (at least
    DISK_READS_MIN transfers): bytes over the wall time the transfers took."""
    import numpy as np

    from engine.experts.tiers.uncached_io import UncachedReader

    reader = UncachedReader()
    slot = np.empty(max((r.nbytes for r in reads), default=0), dtype=np.uint8)
    done = nbytes = 0
    seconds = 0.0
    try:
        for r in reads:
            if done >= DISK_READS_MIN and nbytes >= budget:
                break
            t0 = time.perf_counter()
            if r.parts:  # one read per tensor, as the disk tier's _read_apart
                at = 0
                for offset, n in r.parts:
                    raw = reader.read(r.path, offset, n, scratch=True)
                    np.copyto(slot[at : at + n], np.frombuffer(raw, dtype=np.uint8))
                    at += n
            else:
                raw = reader.read(r.path, r.offset, r.nbytes, scratch=True)
                np.copyto(slot[: r.nbytes], np.frombuffer(raw, dtype=np.uint8))
            seconds += time.perf_counter() - t0
            done, nbytes = done + 1, nbytes + r.nbytes
    finally:
        reader.close()
    return nbytes / max(seconds, 1e-9) / 1e9, done


def core_share(seconds: float = 0.3) -> float:
    """The share of one core this thread gets now (thread CPU time over wall time of a busy loop
    of `seconds`): below 1 where other work shares the cores. The kernels' speeds are CPU-time
    figures (a loaded minute does not change them); a decode's wall time is them over this share."""
    w0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - w0 < seconds:
        pass
    return min(1.0, max(1e-3, (time.thread_time() - c0) / (time.perf_counter() - w0)))


def _thread_seconds(fn: Callable[[], object]) -> float:
    fn()  # warm: first touch, the library's first call
    t0 = time.thread_time()
    fn()
    return max(time.thread_time() - t0, 1e-9)


def _best_one_thread_seconds(sweep: Callable[[], object]) -> float:
    """The best of ROUNDS thread-CPU timings of sweep() at one torch thread (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(_thread_seconds(sweep) for _ in range(ROUNDS))
    finally:
        torch.set_num_threads(threads)


def time_expert_kernel(
    kernels: object, dtype: torch.dtype, expert_quant: str, H: int, I: int, top_k: int
) -> float:
    """GB/s of the native expert kernel (moe_swiglu) running one decode token through `top_k` experts of
    this shape, weights in `dtype` (bf16/f32) or int8 with fp16 row scales, at one thread, in thread CPU
    time, best of ROUNDS, over more expert weights than the caches hold."""
    wdtype = torch.int8 if expert_quant == "int8" else dtype
    es = torch.empty((), dtype=wdtype).element_size()
    per = 3 * H * I * es + (2 * (2 * I + H) if expert_quant == "int8" else 0)
    n = max(top_k, math.ceil(STREAM_BYTES / per))
    n = -(-n // top_k) * top_k
    gate_up = torch.zeros((n, 2 * I, H), dtype=wdtype)
    down = torch.zeros((n, H, I), dtype=wdtype)
    gu_ptr = [gate_up[i].data_ptr() for i in range(n)]
    dn_ptr = [down[i].data_ptr() for i in range(n)]
    scales: tuple[torch.Tensor, torch.Tensor] | None = None
    if expert_quant == "int8":
        scales = (
            torch.full((n, 2 * I), 0.01, dtype=torch.float16),
            torch.full((n, H), 0.01, dtype=torch.float16),
        )
    x = torch.full((1, H), 0.5, dtype=dtype)
    weights = [1.0 / top_k] * top_k

    def sweep() -> None:
        for i in range(0, n, top_k):
            sl = slice(i, i + top_k)
            kernels.moe_swiglu(  # type: ignore[attr-defined]
                x,
                wdtype,
                H,
                intermediate=I,
                gate_up=gu_ptr[sl],
                down=dn_ptr[sl],
                weights=weights,
                gate_up_scale=None
                if scales is None
                else [scales[0][j].data_ptr() for j in range(i, i + top_k)],
                down_scale=None
                if scales is None
                else [scales[1][j].data_ptr() for j in range(i, i + top_k)],
            )

    return n * per / _best_one_thread_seconds(sweep) / 1e9


def time_mxfp4_kernel(kernels: object, dtype: torch.dtype, H: int, I: int, top_k: int) -> float:
    """GB/s of slot bytes of the native MXFP4 expert kernel (mxfp4_moe.c, gpt-oss's experts as shipped)
    running one decode token through `top_k` experts, as time_expert_kernel times moe_swiglu."""
    from engine.experts.compute.native_mxfp4 import NativeMxfp4Moe
    from engine.experts.formats.expert_kernels import GptOssKernel
    from engine.experts.formats.native_quant import Mxfp4GptOssFormat
    from engine.native.decode_shapes import dtype_name

    fmt = Mxfp4GptOssFormat(
        GptOssKernel(H, I, 1.702, 7.0), H, I, dtype_name(dtype), dtype_name(dtype)
    )
    per = fmt.slot_numel  # bytes: the slot is uint8
    n = max(top_k, math.ceil(STREAM_BYTES / per))
    n = -(-n // top_k) * top_k
    slots = torch.zeros((n, per), dtype=torch.uint8)  # zero codes, scales 2^-127 and biases: finite
    moe = NativeMxfp4Moe(kernels, fmt, H, I)  # type: ignore[arg-type]
    ptrs = [moe.pointers(fmt.views(slots[i])) for i in range(n)]
    x = torch.full((1, H), 0.5, dtype=dtype)
    weights = [1.0 / top_k] * top_k

    def sweep() -> None:
        for i in range(0, n, top_k):
            moe.run(x, ptrs[i : i + top_k], weights)

    return n * per / _best_one_thread_seconds(sweep) / 1e9


def _cached(key: list[str], cache: Path, measure: Callable[[], float]) -> tuple[float, bool]:
    """measure() for `key`, from the JSON file `cache` when it holds one, else measured and stored."""
    k = hashlib.sha256("\0".join(key).encode()).hexdigest()[:20]
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(k), (int, float)):
        return float(known[k]), True
    value = measure()
    known[k] = value
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache: measured again next time
    return value, False


def kernel_speeds(
    config: object,
    dtype: str,
    expert_quant: str,
    H: int,
    I: int,
    top_k: int,
    expert_format: str = "none",
) -> KernelSpeeds | None:
    """The dispatcher's measurement for this model's decode shapes (the engine's own call, so its cache
    answers when the engine has loaded this shape here) and the expert kernel's speed for its format;
    None where the native kernels do not build here, or the format has no measured kernel (int4)."""
    from engine.native.autotune import TORCH, measured
    from engine.native.build import compiler, library_path
    from engine.native.decode_shapes import decode_shapes
    from engine.native.loaded import load_builds
    from engine.native.variants import by_name, cpu_flags, cpu_model

    shapes = decode_shapes(config, dtype, H, I, top_k)
    mxfp4 = expert_format == "mxfp4" and expert_quant == "none"  # gpt-oss's experts as shipped
    if (
        shapes is None
        or expert_quant not in ("none", "int8")
        # the probe names the format the experts run in: "int8" where --expert-quant int8 made it
        or expert_format not in ("none", "mxfp4", expert_quant)
    ):
        return None
    builds, _ = load_builds("auto")
    if not builds:
        return None
    ids = {name: library_path(compiler() or "cc", by_name(name)).name for name in builds}
    root = env.cache_root() / "native"
    m = measured(shapes, builds, ids, root / "autotune.json")
    chosen = m.chosen
    gbps = m.gbps[chosen]
    overhead = 0.0
    if m.layer_ms and chosen in m.layer_ms:
        overhead = max(0.0, m.layer_ms[chosen] * 1e-3 - shapes.layer_bytes() / (gbps * 1e9))
    # The experts run through the native kernel wherever it builds (native_moe.py), even where torch
    # streams the dense part faster: the best build's speed, as the loader picks it.
    build = chosen if chosen != TORCH else max(builds, key=lambda n: m.gbps[n])
    key = [
        "moe_mxfp4" if mxfp4 else "moe_swiglu",
        cpu_model(),
        " ".join(sorted(cpu_flags())),
        torch.__version__,
        ids[build],
        f"torch.{dtype}",  # as str(torch.dtype) spelled it: caches written before still answer
        expert_quant,
        f"{H}x{I}x{top_k}",
    ]
    expert, cached = _cached(
        key,
        root / "expert_kernel.json",
        (lambda: time_mxfp4_kernel(builds[build], getattr(torch, dtype), H, I, top_k))
        if mxfp4
        else (
            lambda: time_expert_kernel(
                builds[build], getattr(torch, dtype), expert_quant, H, I, top_k
            )
        ),
    )
    return KernelSpeeds(chosen, gbps, overhead, expert, cached, key[0])


def machine_costs(
    speeds: KernelSpeeds,
    disk_gb_s: float,
    disk_reads: int,
    dense_streamed_bytes: int,
    layers: int,
    slot_bytes: int,
    expert_disk_bytes: int,
    transfer_workers: int,
    cpu_workers: int,
    share: float = 1.0,
) -> Costs:
    """The simulator's costs for a decode on this CPU: `dense_streamed_bytes` (the dense weights a decode
    token reads, head included) spread over `layers`, experts of `slot_bytes` computed at the expert
    kernel's speed, each miss a read of `expert_disk_bytes` at `disk_gb_s`; the compute thread's
    work over `share`, the share of a core it gets (core_share)."""
    dense_s = (
        dense_streamed_bytes / layers / (speeds.dense_gb_s * 1e9) + speeds.dense_overhead_s
    ) / share
    expert_s = slot_bytes / (speeds.expert_gb_s * 1e9) / share
    return Costs(
        profile="measured",
        shape="",
        expert_bytes=expert_disk_bytes,
        link_mb_per_s=disk_gb_s * 1e3,
        link_latency_s=0.0,  # in the rate: it is measured over whole expert-sized reads
        transfer_workers=transfer_workers,
        fast=(expert_s, 0.0),
        cpu=(expert_s, 0.0),
        cpu_workers=cpu_workers,
        dense=(dense_s, 0.0),
        cpu_reads_over_link=True,
        cpu_is_fast_device=True,
        notes=(
            f"dense {speeds.dense_gb_s:.1f} GB/s ({speeds.build}, the kernel dispatcher's measurement)"
            + (
                f" + {speeds.dense_overhead_s * 1e3:.2f} ms a layer"
                if speeds.dense_overhead_s >= 5e-6
                else ""
            ),
            f"experts {speeds.expert_gb_s:.1f} GB/s (native {speeds.expert_kernel}"
            + (", cached)" if speeds.expert_cached else ", measured now)"),
            f"compute over {share:.0%} of a core (what a busy thread got as the plan ran)",
            f"disk {disk_gb_s:.2f} GB/s over {disk_reads} expert transfers (O_DIRECT read + copy into a slot), measured now",
        ),
    )
