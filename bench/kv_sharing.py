"""Agent sessions sharing a long system prompt: the KV pool's memory and a returning turn's TTFT.

One engine in this process on a random-weight long-context qwen3_moe (labelled: its text is noise;
what is measured is memory and time, which do not depend on the weights' values). Two runs, each
on a fresh engine and pool:

1. one session: the shared prefix plus its own suffix, then `--tokens` greedy tokens;
2. `--sessions` sessions arriving together, each the shared prefix plus its own suffix; then the
   first session returns with its history and a new user turn.

Reported: the pool's peak blocks in use (times the bytes a block: every layer's keys and values),
against one session's peak plus each other session's distinct blocks (the issue's bound, +10 %), and
what per-request buffers would hold (8 sessions' own copies: computed, not run); each session's time
to first token; the returning turn's time to first token against the cold session's.

    python -m bench kv-sharing --out docs/benchmarks/kv_sharing.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.report import args_payload, machine_line, write_report
from engine import CoreLimits, EngineConfig, EngineCore, SamplingParams, load_model, portable_path
from models.tiny import make_tiny_checkpoint

SHAPE = dict(  # the shape: 16 KiB of bf16 KV a token
    num_layers=8,
    hidden=512,
    num_key_value_heads=4,
    head_dim=128,
    num_attention_heads=8,
    max_position_embeddings=32768,
)


def long_context_checkpoint(work: Path) -> Path:
    """The random-weight checkpoint of SHAPE under `work` (made once)."""
    ckpt = work / "model"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint(ckpt, "qwen3_moe", dtype=torch.bfloat16, **SHAPE)  # type: ignore[arg-type]
    return ckpt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench kv-sharing", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--prefix", type=int, default=8192, help="shared prefix tokens (default 8192)")
    p.add_argument(
        "--suffix", type=int, default=64, help="each session's own tokens after it (default 64)"
    )
    p.add_argument(
        "--sessions", type=int, default=8, help="sessions sharing the prefix (default 8)"
    )
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens a turn (default 16)")
    p.add_argument(
        "--work", type=Path, default=Path(".cache/kv_sharing"), help="where the checkpoint goes"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a checkpoint to run instead of the tiny long-context one, e.g. the 8-layer Qwen3-30B-A3B "
        "shape of `python -m bench.real_shapes --model qwen3-30b-a3b --layers 8` (prompt ids stay below 250)",
    )
    p.add_argument("--out", type=Path, default=None, help="Markdown page to write (JSON beside it)")
    return p.parse_args(argv)


def _run(
    core: EngineCore, prompts: list[list[int]], tokens: int
) -> tuple[list[float], list[list[int]], int]:
    """Generate for all prompts at once: (each one's TTFT in s, its tokens, the pool's peak blocks in use)."""
    reqs = [
        core.local_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts
    ]
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    peak = 0
    for r in reqs:
        core.add(r)
    while core.has_work():
        for o in core.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            out[o.request_id] += o.token_ids
        assert core.scheduler.blocks is not None
        peak = max(peak, core.scheduler.blocks.counts().in_use)
    return [first[r.request_id] for r in reqs], [out[r.request_id] for r in reqs], peak


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    ckpt = a.model if a.model is not None else long_context_checkpoint(a.work)
    per_session = a.prefix + a.suffix + a.tokens
    om = load_model(ckpt, EngineConfig(device="cpu", kv_tokens=per_session * a.sessions + 4096))
    limits = CoreLimits(max_running=a.sessions, prefill_token_budget=1024, max_model_len=32768)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 250, (a.prefix,), generator=g).tolist()
    suffixes = [torch.randint(3, 250, (a.suffix,), generator=g).tolist() for _ in range(a.sessions)]
    warm = EngineCore.for_model(om, limits)
    _run(warm, [prefix[:512]], 2)  # the kernels' first calls, outside the measurement
    alone = EngineCore.for_model(om, limits)
    (cold_ttft,), _, one_peak = _run(alone, [prefix + suffixes[0]], a.tokens)
    many = EngineCore.for_model(om, limits)
    ttfts, outs, peak = _run(many, [prefix + s for s in suffixes], a.tokens)
    turn = prefix + suffixes[0] + outs[0] + suffixes[1][:32]
    (return_ttft,), _, _ = _run(many, [turn], a.tokens)
    pool = many.runner.pool
    assert pool is not None and many.scheduler.blocks is not None
    block, nbytes = many.scheduler.blocks.block, pool.bytes_per_block
    distinct = -(-(a.suffix + a.tokens + a.prefix % block) // block)  # a session's own blocks
    bound = one_peak + (a.sessions - 1) * distinct
    c = om.config
    shape = (
        f"random-weight {c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_key_value_heads} KV heads of {c.head_dim} ({nbytes // block // 1024} KiB of bf16 KV a token), "
        f"{c.max_position_embeddings // 1024}k context (random weights: the text is noise)"
    )
    om.close()
    mib = nbytes / 2**20
    lines = [
        "| measurement | blocks | MiB |",
        "|---|---|---|",
        f"| one session, peak in use | {one_peak} | {one_peak * mib:.1f} |",
        f"| {a.sessions} sessions together, peak in use | {peak} | {peak * mib:.1f} |",
        f"| bound: one session + {a.sessions - 1} x {distinct} distinct blocks | {bound} | {bound * mib:.1f} |",
        f"| {a.sessions} sessions' own copies (computed, not run) | {a.sessions * one_peak} | {a.sessions * one_peak * mib:.1f} |",
        "",
        "| TTFT | seconds |",
        "|---|---|",
        f"| cold session (alone) | {cold_ttft:.2f} |",
        f"| {a.sessions} sessions together: first / median / last | {min(ttfts):.2f} / {sorted(ttfts)[len(ttfts) // 2]:.2f} / {max(ttfts):.2f} |",
        f"| returning turn (history + 32 new tokens) | {return_ttft:.3f} ({return_ttft / cold_ttft:.3f}x cold) |",
    ]
    header = "\n".join(
        [
            "# KV pool: sessions sharing a long prefix",
            "",
            f"- **Result:** {a.sessions} sessions sharing a {a.prefix}-token prefix hold {peak} KV blocks "
            f"({peak / bound:.2f}x the bound of one session plus the others' distinct blocks; "
            f"{peak / (a.sessions * one_peak):.2f}x their own copies); a returning turn's TTFT is "
            f"{return_ttft / cold_ttft:.3f}x a cold one's.",
            "- **Command:** `python -m bench kv-sharing "
            + ("--model MODEL " if a.model is not None else "")
            + f"--out {portable_path(a.out) if a.out else 'PAGE'}`",
            f"- **Machine:** {machine_line(torch.get_num_threads()).removeprefix('Machine: ').rstrip('.')}; {shape}.",
            "- **Limit:** memory: the distinct positions (each shared block held once); time: a cold "
            "prefill of the prefix against the prefill of the new tokens only.",
        ]
    )
    payload = dict(
        args=args_payload(a),
        one_peak_blocks=one_peak,
        many_peak_blocks=peak,
        bound_blocks=bound,
        block_bytes=nbytes,
        cold_ttft_s=cold_ttft,
        ttfts_s=ttfts,
        return_ttft_s=return_ttft,
    )
    write_report(a.out, header, lines, payload)


if __name__ == "__main__":
    main()
