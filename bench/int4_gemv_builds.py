"""int4 (groups of 64) against int8 (whole rows) gemv, one decode row, one thread, per native build, at the real
expert shapes of Qwen3-30B-A3B ([768, 2048] gate and up, [2048, 768] down). Random weights; 48 distinct
matrices cycled so that none stays cached; interleaved rounds after a warm-up round, medians.

    python -m bench.int4_gemv_builds --builds avx512,avx2 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.kernel_bench import _int4_groups, _int8_rows
from engine import load_build

SHAPES = ((768, 2048), (2048, 768))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--builds",
        default="avx512,avx2",
        help="comma-separated native builds (default avx512,avx2)",
    )
    ap.add_argument(
        "--rounds", type=int, default=7, help="measured rounds after a warm-up (default 7)"
    )
    ap.add_argument(
        "--matrices", type=int, default=48, help="distinct weights per shape (default 48)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = {}
    for rows, cols in SHAPES:
        ws = [torch.randn(rows, cols, generator=g) * 0.02 for _ in range(args.matrices)]
        data[(rows, cols)] = ([_int8_rows(w) for w in ws], [_int4_groups(w) for w in ws])
    xs = {c: torch.randn(1, c, generator=g).bfloat16() for _, c in SHAPES}
    builds = args.builds.split(",")
    kernels = {}
    for b in builds:
        nk, why = load_build(b)
        if nk is None:
            raise SystemExit(f"build {b}: {why}")
        kernels[b] = nk

    def cell(b: str, shape: tuple[int, int], fmt: str) -> float:
        nk, (q8, q4), x = kernels[b], data[shape], xs[shape[1]]
        t0 = time.perf_counter()
        for i in range(args.matrices):
            if fmt == "int8":
                nk.gemv(x, *q8[i])
            else:
                nk.gemv_q4(x, *q4[i])
        return (time.perf_counter() - t0) / args.matrices

    times: dict[tuple[str, tuple[int, int], str], list[float]] = {}
    for rnd in range(args.rounds + 1):
        for key in ((b, s, f) for b in builds for s in SHAPES for f in ("int8", "int4")):
            t = cell(*key)
            if rnd:
                times.setdefault(key, []).append(t)
    for b in builds:
        for s in SHAPES:
            t8, t4 = (statistics.median(times[(b, s, f)]) for f in ("int8", "int4"))
            print(
                f"{b:8s} {s}: int8 {t8 * 1e6:7.1f} us, int4 {t4 * 1e6:7.1f} us: int4 at {t8 / t4:.2f}x int8's speed"
            )


if __name__ == "__main__":
    main()
