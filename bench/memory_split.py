"""KV and experts share one budget: the split moving on a real `moe-offload serve`, read from /metrics.

A random-weight qwen3_moe (8 layers, hidden 512, 16 KiB of bf16 KV a token, 32 experts a layer of 1.5 MiB
each in bf16, top-4; random weights, so the text is noise) served at `--cache-fraction` with the disk
tier, a KV pool planned for `--pool-sessions` prompts. `--sessions` distinct prompts of `--prompt` tokens
arrive at once. Each run is one server: `--kv-borrow-share` at `--share` (the split may move) and at 0
(fixed), interleaved over rounds after a warm-up round. /metrics is scraped every 0.5 s:
`moe_offload_memory_split_bytes{part}` (its peak KV, its lowest experts), the moves, the preemptions; and
the split after the load (idle). Every run's tokens and logprobs are compared, bitwise, with the first.

`--prefix N` makes it an agent's workload: every prompt is one shared N-token prefix followed by its own
`--prompt` tokens, the prefix is served once first (so the sessions find it in the prefix cache), and the
pool is planned for `--pool-sessions` whole contexts (prefix included). `--model DIR` serves an existing
checkpoint instead (the real shape from `python -m bench.real_shapes`).

    python -m bench memory-split --out docs/benchmarks/memory_split.md
    python -m bench memory-split --prefix 8192 --prompt 256 --pool-sessions 1 --out PAGE
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.kv_sharing import SHAPE as KV_SHAPE
from bench.report import args_payload, interleaved, machine_line, write_report
from bench.serve_process import serve
from models.tiny import make_tiny_checkpoint

# bench/kv_sharing.py's long-context shape (16 KiB of bf16 KV a token) with bigger experts: 1.5 MiB each in bf16.
SHAPE = {**KV_SHAPE, "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 512}
SPLIT = "moe_offload_memory_split_bytes"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench memory-split", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--sessions", type=int, default=8, help="distinct prompts sent at once (default 8)"
    )
    p.add_argument(
        "--prompt", type=int, default=1000, help="distinct tokens a prompt (default 1000)"
    )
    p.add_argument(
        "--prefix",
        type=int,
        default=0,
        help="shared prefix tokens before every prompt: an agent's workload (default 0: none)",
    )
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens a request (default 16)")
    p.add_argument(
        "--pool-sessions", type=int, default=2, help="prompts the planned KV pool holds (default 2)"
    )
    p.add_argument(
        "--cache-fraction", type=float, default=0.25, help="the fast tier's share (default 0.25)"
    )
    p.add_argument(
        "--share",
        type=float,
        default=0.5,
        help="--kv-borrow-share of the moving runs (default 0.5)",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="measured rounds after a warm-up (default 2)"
    )
    p.add_argument(
        "--work", type=Path, default=Path(".cache/memory_split"), help="where the checkpoint goes"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="serve this checkpoint instead of building the random one (default: build it)",
    )
    p.add_argument("--out", type=Path, default=None, help="Markdown page to write (JSON beside it)")
    return p.parse_args(argv)


def _complete(base: str, prompt: list[int], tokens: int) -> tuple[int, list[str], list[float]]:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 1}
    r = httpx.post(base + "/v1/completions", json={**body, "ignore_eos": True}, timeout=1800)
    if r.status_code != 200:
        return r.status_code, [], []
    lp = r.json()["choices"][0]["logprobs"]
    return 200, lp["tokens"], lp["token_logprobs"]


def _split(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    def get(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return metrics.get((name, labels), 0.0)

    return {
        "kv": get(SPLIT, (("part", "kv"),)),
        "experts": get(SPLIT, (("part", "experts"),)),
        "moves": get("moe_offload_memory_split_moves_total"),
        "preemptions": get("moe_offload_preemptions_total"),
    }


def _run(
    a: argparse.Namespace, ckpt: Path, prompts: list[list[int]], share: float
) -> dict[str, Any]:
    """One server, the prompts at once, /metrics watched."""
    context = a.prefix + a.prompt + a.tokens
    kv_tokens = a.pool_sessions * context
    args = ["--model", str(ckpt), "--kv-tokens", str(kv_tokens), "--max-running", str(a.sessions)]
    args += ["--max-model-len", str(max(2048, context))]
    args += ["--cache-fraction", str(a.cache_fraction)]
    args += ["--offload", "disk", "--kv-borrow-share", str(share)]
    log = Path(tempfile.mkdtemp()) / "serve.log"
    with serve(args, log, ready_timeout=600) as srv:
        # Warm-up: the shared prefix where there is one (now cached), else a short prompt.
        _complete(srv.base_url, prompts[0][: a.prefix or 64], 2)
        start = _split(srv.metrics())
        samples: list[dict[str, float]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                samples.append(_split(srv.metrics()))
                time.sleep(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(a.sessions) as pool:
            out = list(pool.map(lambda p: _complete(srv.base_url, p, a.tokens), prompts))
        wall = time.perf_counter() - t0
        stop.set()
        watcher.join()
        time.sleep(1.0)  # the engine went idle in its last step; its stats reach the front end
        end = _split(srv.metrics())
    line = next((x for x in log.read_text().splitlines() if x.startswith("memory split:")), "")
    return {
        "share": share,
        "wall_s": wall,
        "ok": sum(s == 200 for s, _, _ in out),
        "start": start,
        "peak_kv": max([s["kv"] for s in samples] + [end["kv"]]),
        "least_experts": min([s["experts"] for s in samples] + [end["experts"]]),
        "idle": end,
        "moves": end["moves"] - start["moves"],
        "preemptions": end["preemptions"] - start["preemptions"],
        "line": line,
        "out": out,
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    ckpt = a.model or a.work / "model"
    if not (ckpt / "config.json").exists():
        make_tiny_checkpoint(ckpt, "qwen3_moe", dtype=torch.bfloat16, **SHAPE)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 250, (a.prefix,), generator=g).tolist()
    prompts = [
        prefix + torch.randint(3, 250, (a.prompt,), generator=g).tolist() for _ in range(a.sessions)
    ]
    res = interleaved((a.share, 0.0), a.rounds, lambda share: _run(a, ckpt, prompts, share))
    runs = [r for cell in res.values() for r in cell]
    same = sum(r["out"] == runs[0]["out"] for r in runs)
    ratio = statistics.median(
        m["wall_s"] / f["wall_s"] for m, f in zip(res[a.share], res[0.0], strict=True)
    )
    lines = [
        "| --kv-borrow-share | round | completed | KV MiB at start / peak / idle after | experts MiB at start / least / idle after | moves | preemptions | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for share, cell in res.items():
        for i, r in enumerate(cell, 1):
            s, e = r["start"], r["idle"]
            lines.append(
                f"| {share:g} | {i} | {r['ok']}/{a.sessions} | {_mib(s['kv'])} / {_mib(r['peak_kv'])} / {_mib(e['kv'])} "
                f"| {_mib(s['experts'])} / {_mib(r['least_experts'])} / {_mib(e['experts'])} | {r['moves']:.0f} "
                f"| {r['preemptions']:.0f} | {r['wall_s']:.1f} |"
            )
    moving = res[a.share][-1]
    lines += ["", "The start-up lines:", "", f"    {moving['line']}", f"    {res[0.0][-1]['line']}"]
    header = "\n".join(
        [
            "# KV and experts share one budget: the split under load",
            "",
            f"Median wall time, split moving / fixed, same round: {ratio:.2f} (a shared 2-core machine: noisy). "
            f"{same} of {len(runs)} runs give the first run's tokens and logprobs, bit for bit.",
            "",
            f"{machine_line(1)} The server runs 1 thread; {a.sessions} prompts of {a.prompt} tokens"
            + (f" after one shared {a.prefix}-token prefix (served once first)" if a.prefix else "")
            + f", {a.tokens} output tokens each, a KV pool planned for {a.pool_sessions} whole context(s), "
            f"--cache-fraction {a.cache_fraction:g} with the disk tier; checkpoint {ckpt.name}, random weights.",
        ]
    )
    payload = dict(
        args=args_payload(a),
        wall_ratio=ratio,
        equal_to_first=same,
        runs=[{k: v for k, v in r.items() if k != "out"} for r in runs],
    )
    write_report(a.out, header, lines, payload)


if __name__ == "__main__":
    main()
