"""Where a decode token's time goes on a GPU, for transformers and for the engine at cache 1.0.

docs/benchmarks/gpu_check.md measured the engine at 0.81x transformers' decode speed on an H200 with
the mid checkpoint, a model so small there that neither is bound by the GPU. This script says why,
from torch.profiler: per generated token, the wall time, how many CUDA kernels ran and how long the
GPU was busy with them (the rest of the wall time the GPU waited for the host), how many copies and
syncs went between host and device, and the host-side operators that took the most time.

    python -m bench.gpu_profile --out docs/benchmarks/gpu_profile.md

`--device cpu` runs the same code on the CPU (a smoke test: no kernels to count there).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.gpu_check import add_gpu_args, gpu_device
from bench.peers import checkpoint
from bench.report import write_report
from engine import EngineConfig, SamplingParams, generate, load_model

# CUDA runtime calls that move data between host and device or wait for the device.
HOST_DEVICE_CALLS = (
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
)


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompt: list[int], n: int) -> None:
    """n greedy tokens from transformers' generate, as bench/engine_bench.py's hf_decode runs it."""
    model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_tokens(run: Callable[[], None], device: torch.device, tokens: int) -> dict[str, Any]:
    """Profile one call of `run` (which generates `tokens` tokens); figures per token."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        run()
        _sync(device)
    wall = time.perf_counter() - t0
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    calls = Counter(e.name for e in events if e.name in HOST_DEVICE_CALLS)
    host = sorted(
        (a for a in prof.key_averages() if a.device_type == DeviceType.CPU),
        key=lambda a: a.self_cpu_time_total,
        reverse=True,
    )[:10]
    return {
        "wall_ms": wall * 1e3 / tokens,
        "kernels": len(kernels) / tokens if device.type == "cuda" else float("nan"),
        "gpu_busy_ms": busy_us / 1e3 / tokens if device.type == "cuda" else float("nan"),
        "host_device_calls": {k: v / tokens for k, v in calls.items()},
        "top_host_ops": [
            (a.key, a.self_cpu_time_total / 1e3 / tokens, a.count / tokens) for a in host
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpu_args(ap)
    ap.add_argument(
        "--tokens", type=int, default=32, help="tokens generated in the profiled call (default 32)"
    )
    args = ap.parse_args()
    device, dev = gpu_device(args, "gpu_profile")
    from transformers import AutoModelForCausalLM

    ckpt = checkpoint(args.work, args.shape)
    hf = (
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype))
        .to(device)
        .eval()
    )
    om = load_model(ckpt, EngineConfig(device=args.device, dtype=args.dtype, cache_fraction=1.0))
    prompt = torch.randint(
        3, hf.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    n = args.tokens
    systems: dict[str, Callable[[], None]] = {
        "transformers": lambda: hf_generate(hf, prompt, n),
        "engine cache 1.0": lambda: (
            generate(om, prompt, SamplingParams(max_tokens=n, ignore_eos=True)) and None
        ),
    }
    res: dict[str, dict[str, Any]] = {}
    for name, run in systems.items():
        run()  # warm-up: kernels chosen, caches built
        res[name] = profile_tokens(run, device, n)
        print(
            f"{name}: {res[name]['wall_ms']:.2f} ms/token, {res[name]['kernels']:.0f} kernels, GPU busy {res[name]['gpu_busy_ms']:.2f} ms",
            flush=True,
        )
    om.close()

    lines = [
        "| per generated token (prefill included) | " + " | ".join(res) + " |",
        "|---|" + "---|" * len(res),
        "| wall time | " + " | ".join(f"{r['wall_ms']:.2f} ms" for r in res.values()) + " |",
        "| CUDA kernels | " + " | ".join(f"{r['kernels']:.0f}" for r in res.values()) + " |",
        "| GPU busy (sum of kernel times) | "
        + " | ".join(f"{r['gpu_busy_ms']:.2f} ms" for r in res.values())
        + " |",
    ]
    for call in HOST_DEVICE_CALLS:
        lines.append(
            f"| {call} calls | "
            + " | ".join(f"{r['host_device_calls'].get(call, 0.0):.1f}" for r in res.values())
            + " |"
        )
    for name, r in res.items():
        lines += [
            "",
            f"Host operators with the most self time, {name} (ms and calls per token):",
            "",
            "| operator | self ms | calls |",
            "|---|---|---|",
        ]
        lines += [f"| `{k}` | {ms:.3f} | {c:.1f} |" for k, ms, c in r["top_host_ops"]]
    header = (
        f"# Where a decode token's time goes on the GPU\n\nDevice: {dev}; torch {torch.__version__}; {args.shape} checkpoint, "
        f"{args.dtype}, {n} generated tokens per profiled call, after a warm-up call; under torch.profiler, "
        "which slows the host side. Command: `python -m bench.gpu_profile` (run by bench/gpu_check.sh)."
    )
    write_report(args.out, header, lines, {"device": dev, "results": res})


if __name__ == "__main__":
    main()
