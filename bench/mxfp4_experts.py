"""gpt-oss-20b's MXFP4 experts, one decode row through a layer's 4 routed experts (H = I = 2880), per native build
against the torch path (dequantize to bf16, then matmul). Random blocks (benchmark-only stand-ins) with scales of
2^-7; interleaved rounds after a warm-up round, the best of each; one thread unless --threads.

    python -m bench.mxfp4_experts --rounds 7
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import GptOssKernel, Mxfp4GptOssFormat, NativeMxfp4Moe, load_build, runnable

H = I = 2880
TOPK = 4


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="timed rounds after a warm-up (default 5)"
    )
    ap.add_argument(
        "--torch-rounds", type=int, default=1, help="rounds of the slow torch path (default 1)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="threads (default 1: steadier on a shared machine)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fmt = Mxfp4GptOssFormat(GptOssKernel(H, I, 1.702, 7.0), H, I, "bfloat16", "bfloat16")
    g = torch.Generator().manual_seed(0)
    slots = []
    for _ in range(TOPK):
        s = torch.randint(0, 256, (fmt.slot_numel,), generator=g, dtype=torch.uint8)
        v = fmt.views(s)
        v[3].fill_(120)  # scales 2^-7: activations stay finite
        v[5].fill_(120)
        v[0].zero_()  # zero biases
        v[1].zero_()
        slots.append(s)
    x = torch.randn(1, H).bfloat16()
    moes = {}
    for name in (v.name for v in runnable()):
        kernels, why = load_build(name)
        if kernels is None:
            print(f"{name}: {why}")
            continue
        moe = NativeMxfp4Moe(kernels, fmt, H, I)
        moes[name] = (moe, [moe.pointers(fmt.views(s)) for s in slots])
    best = {name: float("inf") for name in moes}
    for rnd in range(args.rounds + 1):
        for name, (moe, ptrs) in moes.items():
            t = time.perf_counter()
            moe.run(x, ptrs, [1.0 / TOPK] * TOPK)
            if rnd:
                best[name] = min(best[name], time.perf_counter() - t)
    torch_best = float("inf")
    for _ in range(args.torch_rounds):
        t = time.perf_counter()
        for s in slots:
            fmt.forward(fmt.views(s), x)
        torch_best = min(torch_best, time.perf_counter() - t)
    nbytes = TOPK * fmt.slot_numel
    print(f"{TOPK} experts of [{2 * I}, {H}] + [{H}, {I}] MXFP4, {torch.get_num_threads()} threads")
    for name, sec in best.items():
        print(f"  {name:12s} {sec * 1e3:8.2f} ms  {nbytes / sec / 1e9:5.1f} GB/s")
    print(f"  {'torch':12s} {torch_best * 1e3:8.2f} ms  (dequantize to bf16, then matmul)")


if __name__ == "__main__":
    main()
