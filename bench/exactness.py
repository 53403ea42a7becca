"""Exact under load: the states a busy server moves through, each against plain decoding, bit for bit.

Cells (each request's tokens AND per-token logprobs compared bitwise with the same request alone at
cache 1.0 without speculation, in the checkpoint's own dtype):
  spac      the MoE-SpAc configuration (cache 0.25 from disk behind the hdd link, draft speculation, utility
            prefetch and eviction): --runs fresh engines of --tokens tokens on --prompts prompts each;
  batched   --prompts requests in one batch with CPU-run experts (--cpu-experts all) and draft speculation;
  chunked   prompt logprobs (what lm-eval's loglikelihood requests read) at cache 1.0, at cache 0.25 and 0.1
            from disk, and with the prompt prefilled in chunks of 16 tokens;
  cgroup    `generate --offload disk` of a bf16 random mid-size qwen3_moe under a memory cgroup of 600 MiB +
            40 % of its checkpoint, against the same run unlimited (the engine sizes its fast tier itself).
Writes the table (and JSON beside it) to --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.cgroup import MemoryCgroup
from bench.report import machine_line, positive_int, write_report
from engine import (
    CoreLimits,
    EngineConfig,
    EngineCore,
    SamplingParams,
    SpecConfig,
    complete,
    load_model,
    make_speculation,
)
from models import EMBEDDED_TARGET

PROMPTS = (
    "KING HENRY:\nWhat say you to",
    "First Citizen:\nBefore we proceed any further,",
    "The king said",
    "ROMEO:\nBut soft, what light",
    "To be, or not to be",
    "Once upon a time",
    "import os\n",
    "The json module",
)
SPAC = dict(cache_fraction=0.25, offload="disk", link="hdd", prefetch="utility", eviction="utility")

Run = tuple[list[int], list[float]]


def decode(cell: dict, spec: str, prompts: list[str], tokens: int, batched: bool) -> list[Run]:
    """Greedy tokens and logprobs of each prompt through a fresh engine with `cell`."""
    om = load_model(EMBEDDED_TARGET, EngineConfig(**cell))
    try:
        proposer, observers = make_speculation(
            SpecConfig(speculative=spec).resolve(om.model_dir), om
        )
        ids = [list(om.tokenizer(p)["input_ids"]) for p in prompts]
        groups = [ids] if batched else [[i] for i in ids]
        out: list[Run] = []
        for group in groups:
            limits = CoreLimits(max_running=len(group), max_model_len=512)
            core = EngineCore.for_model(om, limits, proposer, observers)
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            for c in complete(core, [core.local_request(g, params, logprobs=0) for g in group]):
                assert c.error is None, c.error
                out.append((c.token_ids, [lp.logprob for lp in c.logprobs]))
        return out
    finally:
        om.close()


def prompt_logprobs(cell: dict, texts: list[str], budget: int) -> list[list[float]]:
    """Each text's prompt logprobs (teacher-forced, as a loglikelihood request reads them)."""
    om = load_model(EMBEDDED_TARGET, EngineConfig(**cell))
    try:
        out = []
        for t in texts:
            core = EngineCore.for_model(
                om, CoreLimits(max_running=1, prefill_token_budget=budget, max_model_len=1024)
            )
            ids = list(om.tokenizer(t)["input_ids"])
            c = complete(
                core, [core.local_request(ids, SamplingParams(max_tokens=1), prompt_logprobs=0)]
            )[0]
            assert c.error is None, c.error
            out.append([lp.logprob for lp in c.prompt_logprobs if lp is not None])
        return out
    finally:
        om.close()


def compare(ref: list[Run], got: list[Run]) -> dict[str, int]:
    return {
        "requests": len(ref),
        "tokens_equal": sum(a[0] == b[0] for a, b in zip(ref, got, strict=True)),
        "logprobs_equal": sum(a[1] == b[1] for a, b in zip(ref, got, strict=True)),
    }


def spac_cell(args: argparse.Namespace, ref: list[Run]) -> dict[str, Any]:
    runs = [
        compare(ref, decode(SPAC, "draft", PROMPTS[: args.prompts], args.tokens, False))
        for _ in range(args.runs)
    ]
    return {"runs": runs, "exact_runs": sum(r["logprobs_equal"] == r["requests"] for r in runs)}


def batched_cell(args: argparse.Namespace, ref: list[Run]) -> dict[str, Any]:
    cell = dict(cache_fraction=0.25, offload="disk", cpu_experts="all")
    return compare(ref, decode(cell, "draft", list(PROMPTS[: args.prompts]), args.tokens, True))


def chunked_cell(args: argparse.Namespace) -> dict[str, Any]:
    texts = [
        Path(EMBEDDED_TARGET).parent.joinpath("README.md").read_text()[i * 400 : i * 400 + 1200]
        for i in range(3)
    ]
    ref = prompt_logprobs({}, texts, 1024)
    cells = {
        "cache 0.25 disk": (dict(cache_fraction=0.25, offload="disk"), 1024),
        "cache 0.1 disk": (dict(cache_fraction=0.1, offload="disk"), 1024),
        "cache 1.0, chunks of 16": ({}, 16),
    }
    out = {}
    for name, (cell, budget) in cells.items():
        got = prompt_logprobs(cell, texts, budget)
        out[name] = {
            "texts": len(texts),
            "positions": sum(len(r) for r in ref),
            "equal": sum(a == b for a, b in zip(ref, got, strict=True)),
        }
    return out


def cgroup_cell(args: argparse.Namespace) -> dict[str, Any]:
    why = MemoryCgroup.unavailable()
    if why is not None:
        return {"skipped": why}
    from bench.peers import checkpoint

    ckpt = checkpoint(args.work, "mid", torch.bfloat16)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    limit = 600 * 2**20 + int(0.4 * size)
    argv = [
        sys.executable,
        "-m",
        "cli",
        "generate",
        "--model",
        str(ckpt),
        "--offload",
        "disk",
        "--prompt",
        "hello world",
        "--max-tokens",
        str(args.tokens),
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--logprobs",
        "0",
    ]
    free = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    group = MemoryCgroup(limit)
    try:
        limited = group.run(argv, cold=list(ckpt.glob("*.safetensors")))
    finally:
        group.close()
    runs = []
    for p in (free, limited):
        if p.returncode != 0:
            return {"error": p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
        j, _ = json.JSONDecoder().raw_decode(p.stdout[p.stdout.index("{") :])
        runs.append((j["tokens"], [t["logprob"] for t in j["logprobs"]]))
    return {"limit_mib": limit >> 20, "checkpoint_mib": size >> 20, **compare([runs[0]], [runs[1]])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--runs", type=positive_int, default=8, help="fresh engines of the spac cell (default 8)"
    )
    ap.add_argument(
        "--tokens", type=positive_int, default=64, help="greedy tokens a request (default 64)"
    )
    ap.add_argument(
        "--prompts",
        type=positive_int,
        default=4,
        help=f"prompts, at most {len(PROMPTS)} (default 4)",
    )
    ap.add_argument(
        "--cells", default="spac,batched,chunked,cgroup", help="cells to run (default all)"
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/peers"),
        help="where the cgroup cell's checkpoint is built",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="Markdown page to write (JSON beside it)"
    )
    args = ap.parse_args(argv)
    cells = set(args.cells.split(","))
    t0 = time.perf_counter()
    ref = decode({}, "off", list(PROMPTS[: args.prompts]), args.tokens, False)
    payload: dict[str, Any] = {}
    if "spac" in cells:
        payload["spac"] = spac_cell(args, ref)
    if "batched" in cells:
        payload["batched"] = batched_cell(args, ref)
    if "chunked" in cells:
        payload["chunked"] = chunked_cell(args)
    if "cgroup" in cells:
        payload["cgroup"] = cgroup_cell(args)
    lines = ["| cell | what is compared | bitwise equal |", "|---|---|---|"]
    if "spac" in payload:
        s = payload["spac"]
        lines.append(
            f"| MoE-SpAc (0.25 disk, hdd link, draft, utility) | {args.runs} runs x {args.prompts} prompts x {args.tokens} tokens | {s['exact_runs']} of {args.runs} runs (tokens and logprobs) |"
        )
    if "batched" in payload:
        b = payload["batched"]
        lines.append(
            f"| {args.prompts} requests batched, CPU-run experts, draft | tokens / logprobs | {b['tokens_equal']} / {b['logprobs_equal']} of {b['requests']} |"
        )
    for name, c in payload.get("chunked", {}).items():
        lines.append(
            f"| prompt logprobs, {name} | {c['positions']} positions of {c['texts']} texts | {c['equal']} of {c['texts']} texts |"
        )
    if "cgroup" in payload:
        c = payload["cgroup"]
        what = c.get("skipped") or c.get("error")
        lines.append(
            f"| cgroup {c.get('limit_mib', '?')} MiB (checkpoint {c.get('checkpoint_mib', '?')} MiB), disk | tokens / logprobs | "
            + (f"not run: {what}" if what else f"{c['tokens_equal']} / {c['logprobs_equal']} of 1")
            + " |"
        )
    header = (
        f"# Exactness under load\n\nCommand: `python -m bench exactness --runs {args.runs} --tokens {args.tokens} "
        f"--prompts {args.prompts}`. {machine_line(torch.get_num_threads())} Reference: each request alone at cache 1.0, "
        f"speculation off, in the checkpoint's dtype (bf16). Took {time.perf_counter() - t0:.0f} s."
    )
    write_report(args.out, header, lines, payload)


if __name__ == "__main__":
    main()
