"""The many-row (prompt, prefill) cells of bench/kernel_bench.py: GFLOPS of the native gemm against torch.

A prompt multiplies hundreds to thousands of activation rows by each weight, so its kernels are compute-bound:
this times M rows x [N, K] weights through the native kernels (engine/native/gemm.c: register tiles whose every
row is bit for bit the one-row decode kernel's result) and through torch (`F.linear`; for int8 weights torch's
weight-only `_weight_int8pack_mm`), one thread, timed by the calling thread's CPU time (both compute in it at one
thread; the shared host's descheduling does not count), on a square layer and the mid expert shapes, for each
build named (a narrower build runs on a wider CPU, so one machine reports several CPU classes' kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import NativeKernels, load_build

# (label, K in, N out): a square [1024, 1024] layer (attention projections, the mid model's gate_up [2I, H]), an
# expert's gate or up (1024 -> 512) and its down projection (512 -> 1024).
SHAPES = (("1024 -> 1024", 1024, 1024), ("1024 -> 512", 1024, 512), ("512 -> 1024", 512, 1024))
DTYPES = ("f32", "bf16", "int8")


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.abs().amax(1) / 127).half()
    return (w / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8), s


def prefill_cells(
    builds: list[str], rows: list[int]
) -> dict[tuple[str, int, str, str], tuple[Callable[[], object], float]]:
    """(shape, M, dtype, implementation) -> (one call, its floating-point operations)."""
    kernels: dict[str, NativeKernels] = {}
    for name in builds:
        k, why = load_build(name)
        if k is None:
            raise SystemExit(f"--prefill-builds {name}: {why}")
        kernels[name] = k
    g = torch.Generator().manual_seed(2)
    cells: dict[tuple[str, int, str, str], tuple[Callable[[], object], float]] = {}
    for label, K, N in SHAPES:
        w = torch.randn(N, K, generator=g) / K**0.5
        wb, (q, s) = w.bfloat16(), _int8_rows(w)
        for m in rows:
            x = torch.randn(m, K, generator=g)
            xb = x.bfloat16()
            flops = 2.0 * m * K * N
            args = {"f32": (x, w, None), "bf16": (xb, wb, None), "int8": (xb, q, s)}
            torch_calls: dict[str, Callable[[], object]] = {
                "f32": lambda x=x, w=w: F.linear(x, w),
                "bf16": lambda xb=xb, wb=wb: F.linear(xb, wb),
                "int8": lambda xb=xb, q=q, s=s: torch.ops.aten._weight_int8pack_mm(
                    xb, q, s.bfloat16()
                ),
            }
            for dt in DTYPES:
                cells[(label, m, dt, "torch")] = (torch_calls[dt], flops)
                for name, k in kernels.items():
                    cells[(label, m, dt, f"native {name}")] = (
                        lambda k=k, a=args[dt]: k.gemv(*a),
                        flops,
                    )
    return cells


def prefill_lines(med: dict, builds: list[str], rows: list[int]) -> list[str]:
    """The report's table: GFLOPS per cell, and each build's ratio to torch in the same rounds."""
    impls = ["torch", *(f"native {b}" for b in builds)]
    lines = [
        "### Prompt rows (prefill): GFLOPS at 1 thread (thread CPU time), M activation rows x [N, K] weights",
        "",
        "| shape K -> N | M | dtype | "
        + " | ".join(impls)
        + " | "
        + " | ".join(f"{b} / torch" for b in builds)
        + " |",
        "|---|---|---|" + "---|" * (len(impls) + len(builds)),
    ]
    for label, _, _ in SHAPES:
        for m in rows:
            for dt in DTYPES:
                g = {i: med[("prefill", f"{label}|{m}|{dt}|{i}", 1)]["gflops"] for i in impls}
                lines.append(
                    f"| {label} | {m} | {dt} | "
                    + " | ".join(f"{g[i]:.1f}" for i in impls)
                    + " | "
                    + " | ".join(f"{g[f'native {b}'] / g['torch']:.2f}×" for b in builds)
                    + " |"
                )
    return lines
