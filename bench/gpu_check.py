"""The GPU check (issue 15 §6): what a CUDA machine shows that this project's CPU machines cannot.

Run through bench/gpu_check.sh (which installs, checks for a GPU, runs the CUDA-marked tests and
this script, and the MoE-SpAc benchmark on the host-memory tier). This script measures, on one
CUDA device, and writes one markdown page (+ JSON):

1. **Transfers.** Host-to-device GB/s of 64 MiB copies from pinned and from pageable memory, timed
   with CUDA events (the link's peak is the pinned figure), and overlap: a copy on a side stream
   (as engine/experts/tiers/transfers.py issues them) next to a matmul loop on the default stream,
   against each alone. Overlap 1.0 means the shorter one was fully hidden.
2. **The engine's own transfers**: bytes moved over transfer seconds in a cache-0.25 decode with the
   host-memory tier (pinned), against the pinned peak.
3. **Decode tok/s** on the mid peers checkpoint (random qwen3_moe, hidden 1024, 8 layers, 64
   experts, top-8; built once under --work) in bf16: transformers `generate` with the model on the
   GPU, the engine at cache 1.0 and at cache 0.25 (host-memory tier over PCIe, and disk), in rounds
   interleaved after a warm-up round. Greedy tokens of the engine at cache 1.0 are compared with
   transformers' on the same prompt.

    python -m bench.gpu_check --out docs/benchmarks/gpu_check.md

`--device cpu` runs the same code on the CPU (a smoke test of the script; the copy figures are then
host-to-host and meaningless as a link measurement).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.cuda_graphs import attention_graph_figures
from bench.engine_bench import hf_decode
from bench.peers import checkpoint
from bench.report import add_common_flags, write_report
from engine import EngineConfig, SamplingParams, generate, load_model, prompt_logits

ENGINE_CELLS: dict[str, dict[str, Any]] = {
    "engine cache 1.0": dict(cache_fraction=1.0, offload="ram"),
    "engine cache 0.25 (ram, PCIe)": dict(cache_fraction=0.25, offload="ram"),
    "engine cache 0.25 (disk)": dict(cache_fraction=0.25, offload="disk"),
}


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call of fn takes on `device` (CUDA events there, perf_counter on the CPU)."""

    def run(fn: Callable[[], None]) -> float:
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3

    return run


def copy_figures(
    device: torch.device, mib: int = 64, reps: int = 5, matmul_dim: int = 2048
) -> dict[str, float]:
    """H2D GB/s pinned and pageable of `mib` MiB copies, and how far a side-stream copy overlaps a
    default-stream loop of 20 square matmuls of side `matmul_dim`."""
    timed = _timer(device)
    n = mib * 2**20
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    best = lambda fn: min(timed(fn) for _ in range(reps))  # noqa: E731 - best of reps: the link's capability
    out = {
        "pinned_gb_s": n / best(lambda: dst.copy_(pinned, non_blocking=True)) / 1e9,
        "pageable_gb_s": n / best(lambda: dst.copy_(pageable)) / 1e9,
    }
    a = torch.randn(matmul_dim, matmul_dim, device=device)
    side = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def matmuls() -> None:
        for _ in range(20):
            a @ a

    def copy() -> None:
        if side is None:
            dst.copy_(pinned)
            return
        with torch.cuda.stream(side):
            dst.copy_(pinned, non_blocking=True)

    def copy_alone() -> (
        None
    ):  # the timer's events are on the default stream: make it wait for the copy
        copy()
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)

    def both() -> None:
        copy()
        matmuls()
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)

    t_copy, t_mm, t_both = best(copy_alone), best(matmuls), best(both)
    # On the CPU both run one after the other: there is no overlap to measure.
    overlap = (
        max(0.0, min(1.0, (t_copy + t_mm - t_both) / min(t_copy, t_mm)))
        if side is not None
        else float("nan")
    )
    out.update(copy_s=t_copy, matmul_s=t_mm, both_s=t_both, overlap=overlap, matmul_dim=matmul_dim)
    return out


def agreement(hf: torch.nn.Module, om: Any, prompt: list[int], n: int) -> dict[str, float]:
    """How closely the engine follows transformers on the same device and dtype: the length of the
    greedy prefix they share (of n tokens), and the largest logit difference over the prompt."""
    ref = hf_decode(hf, prompt, n)[1][:n]
    ours = list(
        generate(om, prompt, SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True)).token_ids
    )[:n]  # as generate(min_new_tokens=n): no EOS
    prefix = next(
        (i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours))
    )
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([prompt], device=hf.device)).logits[0].float()
    diff = (prompt_logits(om, prompt).float().to(ref_logits.device) - ref_logits).abs().max().item()
    return {
        "tokens": float(n),
        "same_prefix": float(prefix),
        "max_abs_logit_diff": diff,
        "logit_scale": ref_logits.abs().max().item(),
    }


def add_gpu_args(ap: argparse.ArgumentParser) -> None:
    """The flags the GPU scripts share (this one and bench/gpu_profile.py): device, checkpoint, dtype, report."""
    ap.add_argument(
        "--device",
        default="cuda",
        help="compute device (default cuda; cpu: a smoke test of this script)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/peers"),
        help="where the checkpoint is built (default .cache/peers)",
    )
    ap.add_argument(
        "--shape", default="mid", help="checkpoint shape from bench/peers.py (default mid)"
    )
    ap.add_argument(
        "--dtype", default="bfloat16", help="compute dtype of every system (default bfloat16)"
    )
    add_common_flags(ap, threads=False)


def gpu_device(args: argparse.Namespace, prog: str) -> tuple[torch.device, str]:
    """The device `args` ask for and its name; a one-line exit where CUDA is asked for and absent."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"{prog}: no CUDA GPU visible (torch.cuda.is_available() is False); use --device cpu for a smoke test"
        )
    return device, torch.cuda.get_device_name(
        device
    ) if device.type == "cuda" else "CPU (smoke test)"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_gpu_args(ap)
    ap.add_argument(
        "--tokens", type=int, default=64, help="decode tokens per measurement (default 64)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="measured rounds after a warm-up round (default 2)"
    )
    ap.add_argument(
        "--copy-mib", type=int, default=64, help="size of the H2D copies timed, MiB (default 64)"
    )
    ap.add_argument(
        "--matmul-dim",
        type=int,
        default=2048,
        help="side of the square matmuls the copy overlaps (default 2048; smaller for a CPU smoke test)",
    )
    args = ap.parse_args()
    device, name = gpu_device(args, "gpu_check")
    print(f"device: {name}", flush=True)

    copies = copy_figures(device, mib=args.copy_mib, matmul_dim=args.matmul_dim)
    print(
        f"H2D pinned {copies['pinned_gb_s']:.1f} GB/s, pageable {copies['pageable_gb_s']:.1f} GB/s, overlap {copies['overlap']:.2f}",
        flush=True,
    )

    from transformers import AutoModelForCausalLM

    ckpt = checkpoint(args.work, args.shape)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    graphs = attention_graph_figures(hf, device)
    print(
        f"attention sublayer: eager {graphs['eager_s'] * 1e6:.0f} us, CUDA graph {graphs['graph_s'] * 1e6:.0f} us",
        flush=True,
    )
    engines = {
        cell: load_model(ckpt, EngineConfig(device=args.device, dtype=args.dtype, **kw))
        for cell, kw in ENGINE_CELLS.items()
    }
    prompt = torch.randint(
        3, hf.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    cells = ["transformers", *engines]
    res: dict[str, list[float]] = {c: [] for c in cells}
    link: dict[str, float] = {}
    for rnd in range(args.rounds + 1):
        for cell in cells:
            if cell == "transformers":
                tps = hf_decode(hf, prompt, args.tokens)[0]
            else:
                om = engines[cell]
                om.stats.reset()
                r = generate(
                    om, prompt, SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)
                )
                tps = r.decode_tokens_per_s
                s = om.stats.snapshot()
                seconds = sum(s["transfer_seconds"].values())
                if seconds > 0:  # per transfer: with 2 workers, transfers overlap in time
                    link[cell] = s["bytes_moved"] / seconds / 1e9
            if rnd:  # round 0 is the warm-up
                res[cell].append(tps)
        if rnd:
            print(
                f"round {rnd}: " + ", ".join(f"{c} {res[c][-1]:.1f} tok/s" for c in cells),
                flush=True,
            )
    agree = {args.dtype: agreement(hf, engines["engine cache 1.0"], prompt, args.tokens)}
    for om in engines.values():
        om.close()
    if args.dtype != "float32":  # the exact contract is stated in f32: check it on this device too
        del hf
        hf32 = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).eval()
        om32 = load_model(
            ckpt, EngineConfig(device=args.device, dtype="float32", cache_fraction=1.0)
        )
        agree["float32"] = agreement(hf32, om32, prompt, args.tokens)
        om32.close()
        del hf32
    lines = [
        "## Transfers",
        "",
        "| measure | value |",
        "|---|---|",
        f"| H2D, pinned, {args.copy_mib} MiB copies (the link's peak) | {copies['pinned_gb_s']:.2f} GB/s |",
        f"| H2D, pageable | {copies['pageable_gb_s']:.2f} GB/s |",
        f"| copy alone / 20 matmuls alone / both (copy on a side stream) | {copies['copy_s'] * 1e3:.2f} / {copies['matmul_s'] * 1e3:.2f} / {copies['both_s'] * 1e3:.2f} ms |",
        f"| overlap (1.0: the shorter one fully hidden) | {copies['overlap']:.2f} |",
    ]
    for cell, gbs in link.items():
        lines.append(
            f"| {cell}: the engine's transfers (bytes / transfer seconds) | {gbs:.2f} GB/s ({gbs / copies['pinned_gb_s']:.0%} of pinned peak) |"
        )
    lines += [
        "",
        f"## Decode ({args.shape} checkpoint, {args.dtype}, {args.tokens} tokens, medians of {args.rounds} rounds)",
        "",
        "| system | decode tok/s | × transformers |",
        "|---|---|---|",
    ]
    for cell in cells:
        ratio = statistics.median(a / b for a, b in zip(res[cell], res["transformers"]))
        lines.append(f"| {cell} | {statistics.median(res[cell]):.1f} | {ratio:.2f}× |")
    lines += [
        "",
        "## Agreement with transformers (engine at cache 1.0, same device)",
        "",
        "| dtype | greedy tokens shared (prefix) | max abs logit difference on the prompt | largest logit |",
        "|---|---|---|---|",
    ]
    for dt, a in agree.items():
        lines.append(
            f"| {dt} | {a['same_prefix']:.0f} of {a['tokens']:.0f} | {a['max_abs_logit_diff']:.2e} | {a['logit_scale']:.2f} |"
        )
    # What graphs could save: the attention sublayer's launch overhead, in every layer, of one token's time.
    token_s = 1.0 / statistics.median(res["engine cache 1.0"])
    saved = (graphs["eager_s"] - graphs["graph_s"]) * graphs["layers"]
    lines += [
        "",
        "## CUDA graphs for the dense part (bench/cuda_graphs.py)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| layer 0's attention sublayer, one decode token, eager | {graphs['eager_s'] * 1e6:.1f} µs |",
        f"| the same replayed as a CUDA graph (static KV of 512) | {graphs['graph_s'] * 1e6:.1f} µs |",
        f"| saving × {graphs['layers']:.0f} layers, against the engine's {token_s * 1e3:.2f} ms per token at cache 1.0 | "
        f"{saved * 1e3:.2f} ms ({saved / token_s:.0%}) |",
    ]
    header = f"# GPU check\n\nDevice: {name}; torch {torch.__version__}. Command: `python -m bench.gpu_check` (run by bench/gpu_check.sh)."
    write_report(
        args.out,
        header,
        lines,
        {
            "device": name,
            "copies": copies,
            "attention_graph": graphs,
            "engine_link_gb_s": link,
            "rounds": res,
            "agreement": agree,
        },
    )


if __name__ == "__main__":
    main()
