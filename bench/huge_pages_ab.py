"""Huge pages for the weights (EngineConfig.huge_pages) against 4 KiB pages: decode tok/s, side by side.

Each round runs the engine twice, one process each, --no-huge-pages first, then the default, on the same
checkpoint, 1 thread, greedy, after a warm-up request; it prints each process's tok/s and how much of its
memory the kernel backed with huge pages (AnonHugePages). Before the rounds, the native gemv over the
LM head's shape [vocab, hidden] from either kind of page (best of 5, interleaved).

    python -m bench.huge_pages_ab --model .cache/bigram/qwen3-30b-a3b-8l \\
        --config '{"dtype": "bfloat16", "expert_quant": "int8", "quant_cache_dir": ".cache/bigram/quant-cache"}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def head_gemv(vocab: int, hidden: int) -> dict[str, float]:
    """GB/s of the native bf16 gemv over a [vocab, hidden] weight in 4 KiB and in huge pages."""
    from engine import huge_empty, load_builds

    builds, _ = load_builds("auto")
    kernels = next(iter(builds.values()))
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    small = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    huge = huge_empty((vocab, hidden), torch.bfloat16).copy_(small)
    best = {"4k": float("inf"), "huge": float("inf")}
    for _ in range(5):
        for name, w in (("4k", small), ("huge", huge)):
            t = time.perf_counter()
            kernels.gemv(x, w)
            best[name] = min(best[name], time.perf_counter() - t)
    return {k: small.numel() * 2 / v / 1e9 for k, v in best.items()}


def one(model: str, config: dict, tokens: int) -> tuple[float, int]:
    """(tok/s, AnonHugePages MiB) of one decode in this process."""
    from engine import EngineConfig, SamplingParams, generate, load_model

    torch.set_num_threads(1)
    om = load_model(model, EngineConfig(prefix_cache_bytes=0, **config))
    prompt = torch.randint(3, 512, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    generate(om, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    r = generate(om, prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    with open("/proc/self/smaps_rollup") as fh:
        huge = next(int(x.split()[1]) for x in fh if x.startswith("AnonHugePages")) // 1024
    om.close()
    return r.decode_tokens_per_s, huge


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--config", default="{}", help="EngineConfig fields as JSON (both sides)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run (default 64)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default 4)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one side in this process
    args = ap.parse_args()
    config = json.loads(args.config)
    if args.one is not None:
        print(json.dumps(one(args.model, {**config, "huge_pages": args.one == "on"}, args.tokens)))
        return
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model)
    torch.set_num_threads(1)
    g = head_gemv(cfg.vocab_size, cfg.hidden_size)
    print(
        f"native gemv over [{cfg.vocab_size}, {cfg.hidden_size}] bf16: 4 KiB pages {g['4k']:.1f} GB/s, huge pages {g['huge']:.1f} GB/s ({g['huge'] / g['4k']:.2f}x)"
    )
    ratios = []
    for r in range(args.rounds):
        got = {}
        for side in ("off", "on"):
            argv = [
                sys.executable,
                "-m",
                "bench.huge_pages_ab",
                "--model",
                args.model,
                "--config",
                args.config,
                "--tokens",
                str(args.tokens),
                "--one",
                side,
            ]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            got[side] = json.loads(out.strip().splitlines()[-1])
        ratios.append(got["on"][0] / got["off"][0])
        print(
            f"round {r + 1}: 4 KiB pages {got['off'][0]:.2f} tok/s, huge pages {got['on'][0]:.2f} tok/s ({got['on'][1]} MiB in huge pages): {ratios[-1]:.2f}x",
            flush=True,
        )
    print(f"median huge / 4 KiB: {statistics.median(ratios):.2f}x over {args.rounds} rounds")


if __name__ == "__main__":
    main()
