"""Effective weight bandwidth of each decode kernel, against this machine's memory bandwidth.

A decode step multiplies one activation row by every weight once, so a kernel is as good as the
GB/s of weights it streams. For each weight format this times torch's single-row paths and the
native kernels (engine/native/cpu_gemv.c; f32, bf16, int8 rows, int4 groups of 64) on `--matrices`
distinct [rows, cols] weights, so that nothing is served from cache (96 x 2 MB bf16 by default: 192 MB, well past the last-level cache),
and states each as GB/s of weight bytes and as a fraction of the memory's read bandwidth,
measured the way the disk figures are: one sequential pass over a buffer much larger than the
caches (`sum` over 512 MB, which reads each byte once; the best of three passes), in the same rounds.

It also times one token through a layer's 8 experts: expert by expert through torch (what the
engine ran before) against the fused native call, on the peers shapes (tiny: H=256, I=128; mid:
H=1024, I=512), which is where per-call cost shows; and prompt rows (prefill, bench/prefill_cells.py):
GFLOPS of the native gemm against torch at 512 and 4096 rows, one thread, for each build named.

Rounds are interleaved (every cell once per round, a warm-up round first); medians are reported.

    python -m bench.kernel_bench --out docs/benchmarks/kernels.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.prefill_cells import prefill_cells, prefill_lines
from bench.report import interleaved, machine_line, write_report
from engine import native_kernels, quantize_int4, runnable

GB = 1e9


def _timed(fn: Callable[[int], object], n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return time.perf_counter() - t0


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.abs().amax(1) / 127).half()
    return (w / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8), s


def _int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int4 expert format's encoding (engine/experts/formats/quant.py), groups of 64: packed codes, fp16 scales, zeros."""
    packed, s, z = quantize_int4(w, 64)
    return packed.reshape(w.shape[0], -1).contiguous(), s.half().contiguous(), z.half().contiguous()


def _int4_dequant_linear(
    x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, z: torch.Tensor
) -> torch.Tensor:
    """What an int4 expert cost through torch: dequantize the weight, then F.linear."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).view(s.shape[0], s.shape[1], -1)
    return F.linear(x, ((q.to(x.dtype) - z.to(x.dtype)) * s.to(x.dtype)).view(packed.shape[0], -1))


def gemv_cells(rows: int, cols: int, n: int) -> dict[str, tuple[Callable[[int], object], int]]:
    """name -> (call on matrix i, weight bytes per call)."""
    nk = native_kernels()
    g = torch.Generator().manual_seed(0)
    f32 = [torch.randn(rows, cols, generator=g) for _ in range(n)]
    bf16 = [w.bfloat16() for w in f32]
    q8 = [_int8_rows(w) for w in f32]
    q4 = [_int4_groups(w) for w in f32]
    x, xb = torch.randn(1, cols), torch.randn(1, cols).bfloat16()
    numel = rows * cols
    cells: dict[str, tuple[Callable[[int], object], int]] = {
        "f32 torch F.linear": (lambda i: F.linear(x, f32[i]), 4 * numel),
        "bf16 torch F.linear": (lambda i: F.linear(xb, bf16[i]), 2 * numel),
        "bf16 torch.mv": (lambda i: torch.mv(bf16[i], xb[0]), 2 * numel),
        "int8 torch _weight_int8pack_mm": (
            lambda i: torch.ops.aten._weight_int8pack_mm(xb, q8[i][0], q8[i][1].bfloat16()),
            numel,
        ),
        "int4 (groups of 64) torch: dequantize + F.linear": (
            lambda i: _int4_dequant_linear(xb, *q4[i]),
            numel * 9 // 16,
        ),
    }
    if nk is not None:
        cells.update(
            {
                "f32 native": (lambda i: nk.gemv(x, f32[i]), 4 * numel),
                "bf16 native (bf16 dot)": (lambda i: nk.gemv(xb, bf16[i]), 2 * numel),
                "int8 native, bf16 activation (VNNI)": (
                    lambda i: nk.gemv(xb, q8[i][0], q8[i][1]),
                    numel,
                ),
                "int8 native, f32 activation (widened)": (
                    lambda i: nk.gemv(x, q8[i][0], q8[i][1]),
                    numel,
                ),
                "int4 (groups of 64) native, bf16 activation (VNNI)": (
                    lambda i: nk.gemv_q4(xb, *q4[i]),
                    numel * 9 // 16,
                ),
            }
        )
    return cells


def moe_cells(H: int, I: int, k: int = 8, pool: int = 64) -> dict[str, Callable[[], object]]:
    """One token through k of `pool` experts: torch expert by expert vs the fused native call."""
    nk = native_kernels()
    g = torch.Generator().manual_seed(1)
    experts = [
        (
            (torch.randn(2 * I, H, generator=g) / 16).bfloat16(),
            (torch.randn(H, I, generator=g) / 16).bfloat16(),
        )
        for _ in range(pool)
    ]
    x = torch.randn(1, H).bfloat16()
    w = torch.rand(k, generator=g).tolist()
    state = {"round": 0}

    def chosen() -> list[int]:  # a different set of experts every call, as decoding has
        state["round"] = (state["round"] + 1) % (pool // k)
        return list(range(state["round"] * k, state["round"] * k + k))

    def torch_loop() -> torch.Tensor:
        out = None
        for j, e in enumerate(chosen()):
            gate_up, down = experts[e]
            gate, up = torch.mv(gate_up, x[0]).chunk(2)
            y = (torch.mv(down, F.silu(gate) * up) * w[j]).to(x.dtype)
            out = y if out is None else out.add_(y)
        return out

    cells: dict[str, Callable[[], object]] = {"torch, expert by expert": torch_loop}
    if nk is not None:

        def fused() -> torch.Tensor:
            ids = chosen()
            return nk.moe_swiglu(
                x,
                torch.bfloat16,
                H,
                I,
                [experts[e][0].data_ptr() for e in ids],
                [experts[e][1].data_ptr() for e in ids],
                w,
            )

        cells["native, fused"] = fused
    return cells


def memory_read_gbs(buf: torch.Tensor, passes: int = 3) -> float:
    """Read bandwidth: the best of `passes` sequential passes (a sum reads each byte once)."""
    return (
        max(
            buf.numel() * buf.element_size() / _timed(lambda _: buf.sum(), 1) for _ in range(passes)
        )
        / GB
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rows", type=int, default=1024, help="weight rows (output features; default 1024)"
    )
    ap.add_argument(
        "--cols", type=int, default=1024, help="weight columns (input features; default 1024)"
    )
    ap.add_argument(
        "--matrices",
        type=int,
        default=96,
        help="distinct weights cycled through, so none stays cached (default 96)",
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="measured rounds after a warm-up round (default 5)"
    )
    ap.add_argument(
        "--threads", default="1,2", help="comma-separated torch/native thread counts (default 1,2)"
    )
    ap.add_argument(
        "--out", type=Path, help="write a markdown report here (and the numbers as JSON beside it)"
    )
    ap.add_argument(
        "--prefill-builds",
        default="auto",
        help="comma-separated native builds for the prompt-row cells (default auto: the engine's build, "
        "and avx2 where this CPU runs it, for the AVX2 CPU class)",
    )
    ap.add_argument(
        "--prefill-rows",
        default="512,4096",
        help="comma-separated activation row counts of the prompt-row cells (default 512,4096)",
    )
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="time only the prompt-row cells and print them (not with --out: the page keeps every section)",
    )
    args = ap.parse_args()
    if args.prefill_only and args.out:
        ap.error("--prefill-only prints; run every section to write --out")
    nk = native_kernels()
    builds = _prefill_builds(args.prefill_builds, nk.variant if nk is not None else None)
    prows = [int(m) for m in args.prefill_rows.split(",")]
    prefill = prefill_cells(builds, prows)
    threads = [int(t) for t in args.threads.split(",")]
    cells = gemv_cells(args.rows, args.cols, args.matrices)
    shapes = {"tiny (H=256, I=128)": (256, 128), "mid (H=1024, I=512)": (1024, 512)}
    moe = {s: moe_cells(*hw) for s, hw in shapes.items()}
    big = torch.ones(512 * 2**20 // 4)  # 512 MB of f32

    def run(cell: tuple[str, str, int]) -> dict:
        kind, name, t = cell
        torch.set_num_threads(t)
        if kind == "memory":
            return {"gbs": memory_read_gbs(big)}
        if kind == "prefill":
            pfn, flops = prefill[tuple(_split_prefill(name))]
            reps = max(1, round(2e9 / flops))  # about 2 GFLOP a cell
            # One thread computes in the calling thread (torch and native alike): its CPU time leaves out the
            # time the shared host had it descheduled.
            t0 = time.thread_time()
            for _ in range(reps):
                pfn()
            return {"gflops": flops * reps / (time.thread_time() - t0) / GB}
        if kind == "gemv":
            fn, nbytes = cells[name]
            sec = _timed(fn, args.matrices)
            return {"gbs": nbytes * args.matrices / sec / GB, "us": sec / args.matrices * 1e6}
        shape, impl = name.split("|")
        fn = moe[shape][impl]
        reps = 64
        return {"us": _timed(lambda _: fn(), reps) / reps * 1e6}

    grid = [("prefill", "|".join(map(str, c)), 1) for c in prefill]
    if not args.prefill_only:
        grid += [("memory", "sum over 512 MB (f32)", t) for t in threads]
        grid += [("gemv", name, t) for t in threads for name in cells]
        grid += [("moe", f"{s}|{impl}", t) for t in threads for s in shapes for impl in moe[s]]
    res = interleaved(grid, args.rounds, run)
    med = {
        cell: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for cell, runs in res.items()
    }

    lines = prefill_lines(med, builds, prows) + [""]
    if args.prefill_only:
        print("\n".join(lines))
        return
    lines += [
        f"### Weight bandwidth, one activation row, [{args.rows}, {args.cols}] weights, {args.matrices} distinct",
        "",
        "| kernel | "
        + " | ".join(f"{t} thread(s): GB/s, µs/call, × memory read" for t in threads)
        + " |",
        "|---|" + "---|" * len(threads),
    ]
    for name in ["memory read: sum over 512 MB (f32)", *cells]:
        row = []
        for t in threads:
            mem = med[("memory", "sum over 512 MB (f32)", t)]["gbs"]
            if name.startswith("memory"):
                row.append(f"{mem:.2f}, -, 1.00×")
            else:
                m = med[("gemv", name, t)]
                row.append(f"{m['gbs']:.2f}, {m['us']:.0f}, {m['gbs'] / mem:.2f}×")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += [
        "",
        "### One token through 8 of 64 SwiGLU experts (bf16)",
        "",
        "| shape | implementation | " + " | ".join(f"{t} thread(s): µs" for t in threads) + " |",
        "|---|---|" + "---|" * len(threads),
    ]
    for s in shapes:
        for impl in moe[s]:
            lines.append(
                f"| {s} | {impl} | "
                + " | ".join(f"{med[('moe', f'{s}|{impl}', t)]['us']:.0f}" for t in threads)
                + " |"
            )
    kernels = (
        nk.describe().capitalize()
        if nk is not None
        else "Native kernels unavailable on this machine"
    )
    header = (
        f"# Native kernels: prompt rows (GFLOPS) and decode rows (weight bandwidth)\n\n{machine_line(threads[-1])} "
        f"Thread counts: {args.threads}. {kernels}. Medians of {args.rounds} interleaved rounds after a warm-up round."
    )
    write_report(
        args.out, header, lines, {"medians": {"|".join(map(str, c)): v for c, v in med.items()}}
    )


def _prefill_builds(spec: str, engine_build: str | None) -> list[str]:
    """The builds the prompt-row cells time: those named, or the engine's and avx2 where this CPU runs it."""
    if spec != "auto":
        return spec.split(",")
    names = [engine_build] if engine_build else []
    if "avx2" in [v.name for v in runnable()] and "avx2" not in names:
        names.append("avx2")
    return names


def _split_prefill(name: str) -> tuple[str, int, str, str]:
    label, m, dt, impl = name.split("|")
    return label, int(m), dt, impl


if __name__ == "__main__":
    main()
