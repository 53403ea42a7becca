"""Many long prompts at once against a KV pool sized for a few, under a memory cgroup: queue, preempt,
never fail.

The real `moe-offload serve` on a random-weight long-context qwen3_moe (bench/kv_sharing.py's shape:
16 KiB of bf16 KV a token; random weights, so the text is noise), with `--kv-tokens` sized for
`--pool-sessions` prompts. `--sessions` distinct prompts of `--prompt` tokens arrive at once (greedy,
logprobs on, /v1/completions with token ids); then each is sent again alone. Reported: how many
completed, their statuses, the preemptions /metrics counted, whether each request's tokens and
logprobs together equal its own alone (bitwise), the cgroup's peak memory and OOM kills.
Before the paged pool, 24 prompts of 6,000 tokens under 1.5 GiB got the engine OOM-killed: 24 of 24
failed with 503.

    python -m bench kv-pressure --out docs/benchmarks/kv_pressure.md
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.cgroup import MemoryCgroup
from bench.kv_sharing import long_context_checkpoint
from bench.report import args_payload, machine_line, write_report
from bench.serve_process import serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench kv-pressure", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--sessions", type=int, default=32, help="distinct long prompts sent at once (default 32)"
    )
    p.add_argument("--prompt", type=int, default=1000, help="tokens a prompt (default 1000)")
    p.add_argument(
        "--pool-sessions", type=int, default=8, help="prompts the KV pool is sized for (default 8)"
    )
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens a request (default 32)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="the server's context (default 2048: the pool is never smaller than one context)",
    )
    p.add_argument(
        "--cgroup-mib",
        type=int,
        default=1536,
        help="memory cgroup limit, MiB; 0: none (default 1536)",
    )
    p.add_argument(
        "--work", type=Path, default=Path(".cache/kv_sharing"), help="where the checkpoint goes"
    )
    p.add_argument("--out", type=Path, default=None, help="Markdown page to write (JSON beside it)")
    return p.parse_args(argv)


def _complete(base: str, prompt: list[int], tokens: int) -> tuple[int, list[str], list[float]]:
    """(HTTP status, tokens, logprobs) of one greedy completion."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    r = httpx.post(base + "/v1/completions", json=body, timeout=1800)
    if r.status_code != 200:
        return r.status_code, [], []
    lp = r.json()["choices"][0]["logprobs"]
    return 200, lp["tokens"], lp["token_logprobs"]


def _preemptions(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(v for (name, _), v in metrics.items() if name == "moe_offload_preemptions_total")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    ckpt = long_context_checkpoint(a.work)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (a.prompt,), generator=g).tolist() for _ in range(a.sessions)]
    kv_tokens = a.pool_sessions * (a.prompt + a.tokens)
    args = ["--model", str(ckpt), "--kv-tokens", str(kv_tokens), "--max-running", str(a.sessions)]
    args += ["--max-model-len", str(a.max_model_len)]
    cg = MemoryCgroup(a.cgroup_mib << 20) if a.cgroup_mib else None
    log = Path(tempfile.mkdtemp()) / "serve.log"
    try:
        with serve(args, log, ready_timeout=300, enter=cg.enter if cg else None) as srv:
            base = srv.base_url
            _complete(base, prompts[0][:64], 2)  # warm-up
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(a.sessions) as pool:
                together = list(pool.map(lambda p: _complete(base, p, a.tokens), prompts))
            wall = time.perf_counter() - t0
            preempted = _preemptions(srv.metrics())
            alone = [_complete(base, p, a.tokens) for p in prompts]
        oom = cg.oom_kills() if cg else 0
        peak = cg.peak_bytes() if cg else 0
    finally:
        if cg is not None:
            cg.close()
    ok = sum(s == 200 for s, _, _ in together)
    same = sum(t == s for t, s in zip(together, alone, strict=True))
    differ = [  # (request, first position whose token or logprob differs) for the pairs that differ
        (
            i,
            next(j for j, (x, y) in enumerate(zip(zip(*t[1:]), zip(*s[1:]))) if x != y)
            if t[0] == s[0] == 200
            else -1,
        )
        for i, (t, s) in enumerate(zip(together, alone, strict=True))
        if t != s
    ]
    statuses = sorted({s for s, _, _ in together})
    limit = f"{a.cgroup_mib} MiB cgroup" if a.cgroup_mib else "no cgroup"
    lines = [
        "| sessions | prompt tokens | pool sized for | memory | completed | statuses | preemptions | equal to alone (tokens and logprobs) | OOM kills | peak memory (MiB) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {a.sessions} | {a.prompt} | {a.pool_sessions} x {a.prompt + a.tokens} tokens | {limit} | {ok}/{a.sessions} "
        f"| {', '.join(map(str, statuses))} | {preempted:.0f} | {same}/{a.sessions} | {oom} | {peak / 2**20:.0f} | {wall:.0f} |",
    ]
    header = "\n".join(
        [
            "# KV pool under pressure: more long prompts than the pool holds",
            "",
            f"- **Result:** {ok} of {a.sessions} concurrent {a.prompt}-token prompts completed against a KV pool "
            f"for {a.pool_sessions} under a {limit}; {preempted:.0f} preemptions; {same} of {a.sessions} give the "
            f"tokens and logprobs they get alone, bit for bit; {oom} OOM kills.",
            "- **Command:** `python -m bench kv-pressure --out docs/benchmarks/kv_pressure.md`",
            f"- **Machine:** {machine_line(1).removeprefix('Machine: ').rstrip('.')}; the server runs 1 thread; "
            "random-weight qwen3_moe, 8 layers, hidden 512, 16 KiB of bf16 KV a token (random weights: the text "
            "is noise).",
            "- **Limit:** the pool holds what `--kv-tokens` reserved; requests beyond it wait or are preempted "
            "and recompute their positions (the cost: the recomputed prefill).",
        ]
    )
    payload: dict[str, Any] = dict(
        args=args_payload(a),
        completed=ok,
        statuses=statuses,
        preemptions=preempted,
        equal_to_alone=same,
        differ=differ,
        together=together,
        alone=alone,
        oom_kills=oom,
        peak_bytes=peak,
        wall_s=wall,
    )
    write_report(a.out, header, lines, payload)


if __name__ == "__main__":
    main()
