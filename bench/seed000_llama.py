"""Seed 000's last claim, the 0.15-rule engine against stock llama.cpp at equal memory, on the
embedded model: `python -m bench seed-000 --llama-cpp DIR --only-llama` runs it alone and merges it
into the page's JSON as `llama` (bench/seed_000.py).

The paper: with about 16 GB usable, the 0.15-rule engine decodes 2.8-3.0× faster than stock
llama.cpp at the same VRAM, at +1.6 % PPL. On this CPU-only machine the fast tier is RAM, so "the
same VRAM" is the same memory for weights:
- the engine keeps every dense weight and `cache_fraction` of the routed experts in memory and reads
  the rest from the safetensors on disk with uncached I/O; per policy: the 0.15 rule (threshold),
  Quality-First, Speed-First and the exact fetch-all; prefetch off;
- llama-server, stock (its default mmap of the weights), on the same weights as a bf16 GGUF, inside a
  memory cgroup whose limit is its own anonymous memory (runtime, KV cache, compute buffers;
  measured after a warm-up request) plus the same weight bytes: the GGUF's size less the
  (1 - cache_fraction) share of the routed experts' bytes. The kernel keeps at most that many of the
  GGUF's pages and reads the others back from disk when the decode touches them;
- llama-server on a copy of the GGUF with no limit: the whole model in memory.
Decode tok/s of all of them side by side in one interleaved run after a warm-up round (prefill
excluded everywhere; 1 thread each), with the bytes each reads from the disk per token (the engine's
counters; llama-server's /proc/PID/io read_bytes). Perplexity: the engine's teacher-forced per
policy (engine/offline/evaluation.py) and llama-server's on the same windows, one token at a time
(each next token's logprob from the full distribution, `n_probs` = the vocabulary, the prefix cached).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.cgroup import MemoryCgroup, evict_page_cache
from bench.measure_hardware import seq_read_mb_s
from bench.report import interleaved, summarize
from bench.seed000_runs import Run, Setup, score
from bench.seed004_llama import completion
from bench.streams_vs_llama import convert, llama_server

# label -> EngineConfig overrides, the exact policy first (every PPL change is against it)
POLICIES: dict[str, dict[str, Any]] = {
    "fetch-all": {"policy": "fetch-all"},
    "threshold": {"policy": "threshold"},
    "quality-first": {"policy": "quality-first"},
    "speed-first": {"policy": "speed-first"},
}
LIMITED = "llama-server, memory = dense + the engine's expert share"
FREE = "llama-server, whole model in memory"
MARGIN = 2 << 20  # above the measured anonymous memory: allocator slack while decoding
KEYS = ("tok_s", "read_MB_per_token")


@dataclass(frozen=True)
class LlamaSetup:
    llama_cpp: Path  # a source tree with build/bin/llama-server and convert_hf_to_gguf.py
    model_dir: Path
    cache_fraction: float
    prompts: list[list[int]]  # one per round, warm-up included
    tokens: int
    rounds: int
    windows: list[list[int]]  # perplexity windows
    work: Path
    threads: int = 1


def expert_bytes(model_dir: Path) -> int:
    """Bytes of the routed experts' tensors in the checkpoint's safetensors files (their headers)."""
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(
            t["data_offsets"][1] - t["data_offsets"][0]
            for name, t in header.items()
            if ".mlp.experts." in name
        )
    return total


def experts_each(s: LlamaSetup) -> int:
    """One routed expert's bytes in the checkpoint (the engine's read size)."""
    cfg = json.loads((s.model_dir / "config.json").read_text())
    n = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"]
    return expert_bytes(s.model_dir) // (n * experts)


def buffered_read_mb_s(path: Path) -> float:
    """The file read through the page cache from cold, 1 MiB at a time (as mmap faults read, with
    the kernel's readahead), MB/s."""
    evict_page_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        n = sum(len(b) for b in iter(lambda: fh.read(1 << 20), b""))
    return n / (time.perf_counter() - t0) / 1e6


def read_ahead_kb(path: Path) -> int | None:
    """The read-ahead of the block device holding `path` (/sys/dev/block/MAJ:MIN), None where unknown."""
    dev = os.stat(path).st_dev
    for name in (f"{os.major(dev)}:{os.minor(dev)}", f"{os.major(dev)}:0"):
        f = Path("/sys/dev/block") / name / "queue/read_ahead_kb"
        if f.exists():
            return int(f.read_text())
    return None


def read_bytes(pid: int) -> int:
    """Bytes the process has read from storage so far (/proc/PID/io: page cache hits excluded)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def llama_ppl(url: str, windows: list[list[int]]) -> float:
    """llama-server's perplexity on `windows`, every token after the first scored from its prefix."""
    nll, n = 0.0, 0
    for w in windows:
        for i in range(1, len(w)):
            body = dict(
                prompt=w[:i], n_predict=1, n_probs=1 << 20, temperature=0.0, cache_prompt=True
            )
            r = httpx.post(url + "/completion", json=body, timeout=300).json()
            top = r["completion_probabilities"][0]["top_logprobs"]
            nll -= next(t["logprob"] for t in top if t["id"] == w[i])
            n += 1
    return math.exp(nll / max(n, 1))


def engine_ppl(s: LlamaSetup) -> dict[str, float]:
    setup = Setup(s.model_dir, s.cache_fraction)
    return {
        label: score(setup, Run(label, over), s.windows).ppl() for label, over in POLICIES.items()
    }


def run(s: LlamaSetup) -> dict[str, Any]:
    """Decode speed side by side, the memory each was given, and perplexity (the module docstring)."""
    from bench.spec_bench import run_cell
    from engine import EngineConfig, SpecConfig, load_model

    gguf = convert(s.llama_cpp, s.model_dir, s.work / "target-bf16.gguf")
    free_copy = s.work / "target-bf16-free.gguf"  # its own page cache: the limited one shares none
    if not free_copy.exists():
        shutil.copyfile(gguf, free_copy)
    experts = expert_bytes(s.model_dir)
    weights = gguf.stat().st_size - round((1 - s.cache_fraction) * experts)
    exe = s.llama_cpp / "build/bin/llama-server"
    ctx = max(len(p) for p in s.prompts) + s.tokens + 16
    cg = MemoryCgroup(1 << 40)
    stack = ExitStack()
    engines = {
        label: load_model(
            s.model_dir,
            EngineConfig(cache_fraction=s.cache_fraction, offload="disk", prefetch="none", **over),
        )
        for label, over in POLICIES.items()
    }
    try:
        evict_page_cache(gguf)  # its pages are read, and charged, inside the group
        lim_url, lim_pid = stack.enter_context(
            llama_server(
                exe, gguf, 1, ctx, s.threads, s.work / "llama-limited.log", preexec=cg.enter
            )
        )
        free_url, free_pid = stack.enter_context(
            llama_server(exe, free_copy, 1, ctx, s.threads, s.work / "llama-free.log")
        )
        completion(
            lim_url, s.prompts[0], s.tokens, drafting=False
        )  # its buffers allocated, its pages touched
        anon = cg.anon()
        limit = anon + weights + MARGIN
        cg.set_limit(limit)
        urls = {LIMITED: (lim_url, lim_pid), FREE: (free_url, free_pid)}
        cells = [*POLICIES, LIMITED, FREE]
        turn = dict.fromkeys(cells, 0)
        plain = SpecConfig(speculative="off")

        def one(cell: str) -> dict[str, float]:
            prompt = s.prompts[turn[cell] % len(s.prompts)]
            turn[cell] += 1
            if cell in urls:
                url, pid = urls[cell]
                before = read_bytes(pid)
                r = completion(url, prompt, s.tokens, drafting=False)
                return {
                    "tok_s": r["tok_s"],
                    "read_MB_per_token": (read_bytes(pid) - before) / 1e6 / s.tokens,
                }
            r = run_cell(engines[cell], plain, [prompt], s.tokens)
            st = r.pop("stats")
            return {
                "tok_s": r["tok_s"],
                "read_MB_per_token": st["bytes_moved"] / 1e6 / r["produced"],
            }

        res = interleaved(cells, s.rounds, one)
        speed = []
        for cell in cells:
            med = summarize(res, cell, LIMITED, KEYS)
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(res[cell], res[LIMITED])]
            speed.append(
                {
                    "system": cell,
                    "vs_llama_limited": med.pop("ratio"),
                    "round_ratios": ratios,
                    **med,
                }
            )
        peak = cg.peak_bytes()
        disk = {
            f"O_DIRECT {c >> 10} KiB": seq_read_mb_s(s.model_dir, c, 64)
            for c in (experts_each(s), 1 << 20)
        }
        disk["buffered 1024 KiB (the kernel's readahead)"] = buffered_read_mb_s(free_copy)
        t0 = time.perf_counter()
        ppl_llama = llama_ppl(free_url, s.windows)
        ppl_seconds = time.perf_counter() - t0
    finally:
        stack.close()
        for om in engines.values():
            om.close()
        cg.close()
    return {
        "speed": speed,
        "memory": {
            "expert_bytes": experts,
            "gguf_bytes": gguf.stat().st_size,
            "weight_budget": weights,
            "llama_anon": anon,
            "limit": limit,
            "llama_peak": peak,
            "engine_fast_tier": round(s.cache_fraction * experts),
        },
        "ppl": {
            "engine": engine_ppl(s),
            "llama.cpp": ppl_llama,
            "tokens": sum(len(w) - 1 for w in s.windows),
        },
        "ppl_seconds": ppl_seconds,
        "disk_mb_s": disk,
        "read_ahead_kb": read_ahead_kb(gguf),
        "load_average": os.getloadavg()[0],
    }
