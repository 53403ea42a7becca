"""The engine beside llama.cpp on the Qwen3-30B-A3B shape at a reduced depth: all-resident decode at equal
bits, and prefill at cache 1.0 and through the disk tier, from one interleaved run.

What it builds (once, under --work; reused by later runs):
  - a random-weight checkpoint with Qwen3-30B-A3B's released config and tensor names (bench/real_shapes.py),
    `--layers` decoder layers of the released per-layer shape (default 8 of 48);
  - its GGUF files: bf16 from llama.cpp's own convert_hf_to_gguf.py (bench/peers.py's `convert`), then
    Q8_0 and Q4_0 from that bf16 file with llama.cpp's llama-quantize (its default tensor mix: the dense
    tensors are quantized too, which leaves llama.cpp fewer bytes to read than the engine, whose
    quantization covers the routed experts only);
  - llama.cpp itself where no build is found (bench/peers.py's `find_llama_cpp`, plus the llama-quantize
    target).

What it measures, every cell once per round, rounds interleaved after a warm-up round (discarded):
  a. decode tok/s, every expert resident, at each of --threads: engine bf16 / llama.cpp bf16, engine int8
     experts (whole rows) / Q8_0, engine int4 experts (groups of 64) / Q4_0; --tokens greedy tokens after
     a 16-token prompt (llama-bench -p 0 -n N), prefill excluded;
  b. prefill tok/s of a --prefill-tokens prompt: engine bf16 at cache 1.0 against llama-bench's prompt
     processing (-p N -n 0) on the bf16 GGUF; and the engine reading experts from the checkpoint on disk
     (--offload disk, uncached I/O) with the fast tier the memory plan gives the full-depth checkpoint on
     this machine (planned from a headers-only full-depth checkpoint: no disk space), as a share of
     all experts. The prompt goes through in chunks of --prefill-token-budget tokens (default: the whole
     prompt, one chunk): a chunk groups its rows per expert, so each expert a layer needs is read once
     per chunk, and one chunk reads each at most once for the whole prompt.
Every engine cell runs in a process of its own (its memory is returned before the next cell runs); each
llama-bench run is its own process too. llama.cpp's figure is the faster of its mmap and read-into-memory
loading modes (bench/peers.py's `llama_bench_tps`).

Random weights route without the locality of a trained model: consecutive tokens reuse experts far less
than a real Qwen3 does, so every figure that depends on the cache (the disk cell) is pessimistic.

    python -m bench.real_shapes_bench --tiny --work .cache/realbench-dry --rounds 1      # pipeline check, a minute
    python -m bench.real_shapes_bench --layers 8 --work .cache/realbench --out docs/benchmarks/real_shapes.md
    python -m bench.real_shapes_bench --bigger-than-ram --layers 8 --work .cache/bigram --out docs/benchmarks/real_shapes.md

--bigger-than-ram runs bench/bigger_than_ram.py instead: the engine's `--offload disk` against llama.cpp's mmap
under memory cgroups (root or a delegated cgroup), appended to --out as its own section.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.real_shapes_files import MODEL, QUANT_TYPES, build_checkpoint

PROMPT_VOCAB = 512  # the builder's tokenizer (models/tiny.py make_tokenizer(512)): ids below it
DECODE_PROMPT = 16


@dataclass(frozen=True)
class Pair:
    """One engine cell: its name and EngineConfig fields (beside cache 1.0 and the RAM tier)."""

    name: str
    engine: dict[str, Any]


PAIRS = (
    Pair("bf16", {"dtype": "bfloat16"}),
    Pair("int8", {"dtype": "bfloat16", "expert_quant": "int8"}),
    Pair("int4", {"dtype": "bfloat16", "expert_quant": "int4"}),
    # --dense-quant int8 on top: the dense tensors int8 too, the bytes of llama-quantize's Q8_0 mix
    Pair("int8-dense", {"dtype": "bfloat16", "expert_quant": "int8", "dense_quant": "int8"}),
)
# llama-quantize outputs: "-mix" is its default tensor mix (dense tensors quantized too, output Q6_K at
# Q4_0); the plain kinds quantize the routed experts only and keep the dense tensors bf16, as the engine does.
LLAMA_KINDS = ("bf16", *QUANT_TYPES)
# (engine pair, GGUF kind, label) of the decode table
DECODE_PAIRS = (
    ("bf16", "bf16", "bf16 / bf16"),
    ("int8", "q8_0", "int8 / Q8_0 (experts; dense bf16 in both)"),
    ("int4", "q4_0", "int4 / Q4_0 (experts; dense bf16 in both)"),
    ("int8", "q8_0-mix", "int8 / Q8_0 llama-quantize default mix"),
    ("int8-dense", "q8_0-mix", "int8, --dense-quant int8 / Q8_0 llama-quantize default mix"),
    ("int4", "q4_0-mix", "int4 / Q4_0 llama-quantize default mix"),
)


# -- checkpoint and GGUF files ------------------------------------------------------------------
def gguf_files(src: Path, ckpt: Path) -> dict[str, Path]:
    """bf16 from llama.cpp's converter, Q8_0 and Q4_0 from it with llama-quantize (QUANT_TYPES)."""
    from bench.peers import build_target, convert

    bf16 = convert(src, ckpt, "bf16")
    out = {"bf16": bf16}
    quantize = build_target(src, "llama-quantize")
    for kind, (qtype, extra) in QUANT_TYPES.items():
        path = ckpt.parent / f"{ckpt.name}-{kind}.gguf"
        if not path.exists():
            print(f"llama-quantize {bf16.name} -> {path.name} ...", flush=True)
            tmp = path.with_suffix(".part")
            subprocess.run(
                [str(quantize), *extra, str(bf16), str(tmp), qtype],
                check=True,
                capture_output=True,
                timeout=3600,
            )
            tmp.rename(path)
        out[kind] = path
    return out


def full_depth_share(work: Path, host_memory: str | None) -> dict[str, Any]:
    """The memory plan for the full-depth checkpoint on this machine with --offload disk (from a
    headers-only checkpoint, so no disk space): the share of all experts its fast tier holds."""
    from bench.real_shapes import write_checkpoint
    from engine import EngineConfig, machine_ahead, resolve

    path = work / f"{MODEL}-sparse"
    if not (path / ".complete").exists():
        write_checkpoint(path, MODEL, sparse=True, progress=False)
        (path / ".complete").write_text("")
    cfg = EngineConfig(offload="disk", dtype="bfloat16", host_memory=host_memory)
    plan = resolve(path, cfg, machine_ahead(cfg)).memory
    return {
        "share": plan.n_slots / plan.total_experts,
        "n_slots": plan.n_slots,
        "total_experts": plan.total_experts,
        "host_budget": plan.host_budget,
        "host_source": plan.host_source,
    }


# -- one engine cell, in a process of its own ------------------------------------------------------
def engine_cell(
    ckpt: str,
    fields: dict[str, Any],
    threads: list[int],
    tokens: int,
    prefill_tokens: int,
    budget: int,
    decode: bool,
    prefill: bool,
) -> dict[str, Any]:
    """Load the engine with `fields`, then decode tok/s and/or prefill tok/s at each thread count, and
    what the prefill read from the slow tier. Runs in a child process (see `in_child`)."""
    import torch

    from bench.peers import engine_tps
    from engine import (
        CoreLimits,
        EngineConfig,
        EngineCore,
        SamplingParams,
        complete,
        generate,
        load_model,
    )

    torch.set_num_threads(threads[0])
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(3, PROMPT_VOCAB, (DECODE_PROMPT,), generator=gen).tolist()
    long = torch.randint(3, PROMPT_VOCAB, (prefill_tokens,), generator=gen).tolist()
    t0 = time.perf_counter()
    om = load_model(ckpt, EngineConfig(prefix_cache_bytes=0, **fields))
    out: dict[str, Any] = {
        "load_s": time.perf_counter() - t0,
        "n_slots": om.memory_plan.n_slots,
        "total_experts": om.memory_plan.total_experts,
        "offload": om.memory_plan.offload,
        "decode": {},
        "prefill": {},
    }
    try:
        generate(
            om, short, SamplingParams(max_tokens=4, ignore_eos=True)
        )  # first calls, kernel checks
        for t in threads:
            torch.set_num_threads(t)
            if decode:
                out["decode"][t] = engine_tps(om, short, tokens)
            if prefill:
                core = EngineCore.for_model(
                    om, CoreLimits(max_running=1, prefill_token_budget=budget, max_model_len=4096)
                )
                om.stats.reset()
                c = complete(
                    core, [core.local_request(long, SamplingParams(max_tokens=1, ignore_eos=True))]
                )[0]
                s = om.stats.snapshot()
                out["prefill"][t] = prefill_tokens / c.prefill_seconds
                out.setdefault("prefill_read", {})[t] = {
                    "bytes": s["bytes_moved"],
                    "misses": s["misses"],
                    "transfer_s": sum(s["transfer_seconds"].values()),
                    "seconds": c.prefill_seconds,
                }
    finally:
        om.close()
    return out


def in_child(**kw: Any) -> dict[str, Any]:
    """`engine_cell` in a fresh spawned process, so each cell starts from an empty heap."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(engine_cell, **kw).result()


# -- summaries (pure) ---------------------------------------------------------------------------
def paired(a: list[float], b: list[float]) -> tuple[list[float], float]:
    """Per-round ratios a/b (both cells ran under that round's load) and their median."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired rounds need equal, non-empty lists, got {len(a)} and {len(b)}")
    per = [x / y for x, y in zip(a, b)]
    return per, statistics.median(per)


def ratio_rows(
    res: dict[str, list[float]], comparisons: list[tuple[str, str, str]]
) -> list[dict[str, Any]]:
    """One row per (label, engine key, llama.cpp key) whose rounds were both measured."""
    rows = []
    for label, a, b in comparisons:
        if res.get(a) and res.get(b):
            per, med = paired(res[a], res[b])
            rows.append(
                {
                    "what": label,
                    "engine": statistics.median(res[a]),
                    "llama": statistics.median(res[b]),
                    "per_round": per,
                    "ratio": med,
                }
            )
    return rows


def render(rows: list[dict[str, Any]], unit: str) -> list[str]:
    """A markdown table: medians, per-round ratios and their median."""
    lines = [
        f"| cell | engine {unit} | llama.cpp {unit} | engine / llama.cpp per round | median ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        per = ", ".join(f"{x:.2f}" for x in r["per_round"])
        lines.append(
            f"| {r['what']} | {r['engine']:.2f} | {r['llama']:.2f} | {per} | **{r['ratio']:.2f}×** |"
        )
    return lines


# -- the run ------------------------------------------------------------------------------------
def machine_words() -> str:
    model = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    flags = open("/proc/cpuinfo").read().split()
    isa = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
    mem = next(
        int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal")
    )
    return (
        f"{model} ({platform.machine()}, {os.cpu_count()} logical CPUs, {', '.join(isa)}), "
        f"{mem / 2**30:.1f} GiB RAM, shared with other jobs"
    )


def main(argv: list[str] | None = None) -> None:
    from bench.report import positive_int

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--layers",
        type=positive_int,
        default=8,
        help="decoder layers of the Qwen3-30B-A3B shape (default 8 of the released 48; the per-layer shape is kept)",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="cut the per-layer width to a few dozen (the test builder's): a quick check of the whole pipeline, not a benchmark",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/realbench"),
        help="where the checkpoint, GGUF files, quantized-expert cache and (if built here) llama.cpp go (default .cache/realbench)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        help="a llama.cpp source tree with build/bin/llama-bench (default: find one under --work, else build it there)",
    )
    ap.add_argument(
        "--threads",
        default="1",
        help="comma-separated thread counts for every cell (default 1; e.g. 1,2)",
    )
    ap.add_argument(
        "--tokens",
        type=positive_int,
        default=32,
        help="greedy decode tokens per decode measurement (default 32)",
    )
    ap.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=512,
        help="prompt tokens of the prefill cells (default 512, llama-bench -p 512)",
    )
    ap.add_argument(
        "--prefill-token-budget",
        type=positive_int,
        help="the engine's prefill chunk in tokens (default: --prefill-tokens, the whole prompt in one chunk, "
        "so each expert a layer needs is read once for the prompt)",
    )
    ap.add_argument(
        "--host-memory",
        help="host memory for the full-depth plan that sizes the disk cell's fast tier (BYTES or FRACTION, as "
        "`moe-offload plan --host-memory`; default: what the machine has available, as the engine measures it)",
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="measured rounds after one warm-up round (default 2)",
    )
    ap.add_argument(
        "--out", type=Path, help="write a markdown report here (and the numbers as JSON beside it)"
    )
    ap.add_argument(
        "--bigger-than-ram",
        action="store_true",
        help="instead: the bigger-than-memory cells under memory cgroups (bench/bigger_than_ram.py), appended to --out as a section",
    )
    ap.add_argument(
        "--limits",
        default="4,6",
        metavar="GIB",
        help="--bigger-than-ram: memory cgroup limits in GiB for the Qwen3-30B-A3B cells (default 4,6)",
    )
    ap.add_argument(
        "--oss-limit",
        type=float,
        default=6.0,
        metavar="GIB",
        help="--bigger-than-ram: the cgroup limit of the full-depth gpt-oss-20b cell in GiB (default 6; 0 skips it)",
    )
    ap.add_argument(
        "--kinds",
        default="bf16,int8,mxfp4",
        help="--bigger-than-ram: the engine expert kinds to run (default bf16,int8,mxfp4: Qwen3 bf16 / bf16 GGUF, Qwen3 int8 / Q8_0, gpt-oss MXFP4 / MXFP4)",
    )
    ap.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="--bigger-than-ram: the engine cells alone (llama.cpp's columns say 'not run')",
    )
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="--bigger-than-ram: no warm-up round before the measured ones (each cell starts from a cold page cache anyway)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="--bigger-than-ram: keep the checkpoints, GGUF files and quantized-expert cache (default: deleted at the end)",
    )
    args = ap.parse_args(argv)
    from tqdm.auto import tqdm

    from bench.peers import find_llama_cpp, llama_bench_tps
    from bench.report import write_report

    threads = [int(t) for t in args.threads.split(",")]
    budget = args.prefill_token_budget or args.prefill_tokens
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.bigger_than_ram:
        from bench.bigger_than_ram import run as bigger_than_ram

        cmd = "python -m bench.real_shapes_bench " + shlex.join(
            argv if argv is not None else sys.argv[1:]
        )
        found, why = (None, "") if args.no_llama_cpp else find_llama_cpp(work, args.llama_cpp)
        if found is None and not args.no_llama_cpp:
            sys.exit(why)
        bigger_than_ram(args, found, work, cmd)
        return
    src, why = find_llama_cpp(work, args.llama_cpp)
    if src is None:
        sys.exit(why)
    ckpt = build_checkpoint(work, args.layers, args.tiny)
    ggufs = gguf_files(src, ckpt)
    share = full_depth_share(work, args.host_memory)
    quant_dir = str(work / "quant-cache")
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))

    def eng(pair: Pair) -> dict[str, Any]:
        return in_child(
            ckpt=str(ckpt),
            fields={"cache_fraction": 1.0, "offload": "ram", "quant_cache_dir": quant_dir}
            | pair.engine,
            threads=threads,
            tokens=args.tokens,
            prefill_tokens=args.prefill_tokens,
            budget=budget,
            decode=True,
            prefill=pair.name == "bf16",
        )

    def disk() -> dict[str, Any]:
        return in_child(
            ckpt=str(ckpt),
            fields={"cache_fraction": share["share"], "offload": "disk", "dtype": "bfloat16"},
            threads=threads,
            tokens=args.tokens,
            prefill_tokens=args.prefill_tokens,
            budget=budget,
            decode=False,
            prefill=True,
        )

    res: dict[str, list[float]] = {}
    details: list[dict[str, Any]] = []

    def keep(rnd: int, key: str, value: float) -> None:
        if rnd:
            res.setdefault(key, []).append(value)

    steps = [
        *(("engine", p.name) for p in PAIRS),
        *(("llama", k) for k in LLAMA_KINDS),
        ("disk", "bf16"),
    ]
    pairs = {p.name: p for p in PAIRS}
    for rnd in tqdm(range(args.rounds + 1), desc="rounds (first is warm-up)"):
        bar = tqdm(steps, desc=f"round {rnd}", leave=False)
        for kind, name in bar:
            bar.set_postfix_str(f"{kind} {name}")
            if kind == "engine":
                pair = pairs[name]
                r = eng(pair)
                for t, v in r["decode"].items():
                    keep(rnd, f"engine {pair.name} decode|{t}", v)
                for t, v in r["prefill"].items():
                    keep(rnd, f"engine bf16 prefill|{t}", v)
                details.append({"round": rnd, "cell": f"engine {pair.name}", **r})
            elif kind == "llama":
                for t in threads:
                    keep(
                        rnd,
                        f"llama {name} decode|{t}",
                        llama_bench_tps(src, ggufs[name], args.tokens, t),
                    )
                    if name == "bf16":
                        keep(
                            rnd,
                            f"llama bf16 prefill|{t}",
                            llama_bench_tps(src, ggufs["bf16"], 0, t, prompt=args.prefill_tokens),
                        )
            else:
                r = disk()
                for t, v in r["prefill"].items():
                    keep(rnd, f"engine disk prefill|{t}", v)
                details.append({"round": rnd, "cell": "engine disk", **r})

    decode_rows = ratio_rows(
        res,
        [
            (f"{label}, {t} thread(s)", f"engine {a} decode|{t}", f"llama {b} decode|{t}")
            for t in threads
            for a, b, label in DECODE_PAIRS
        ],
    )
    prefill_rows = ratio_rows(
        res,
        [
            (f"{what}, {t} thread(s)", f"engine {key} prefill|{t}", f"llama bf16 prefill|{t}")
            for t in threads
            for what, key in (
                ("bf16 cache 1.0 / bf16", "bf16"),
                (f"bf16 disk, cache {share['share']:.2f} / bf16 (all in RAM)", "disk"),
            )
        ],
    )
    disk_reads = [d for d in details if d["cell"] == "engine disk" and d["round"]]
    read = disk_reads[-1]["prefill_read"][threads[0]] if disk_reads else None
    cmd = "python -m bench.real_shapes_bench " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    header = "\n".join(
        [
            f"# Real shapes: Qwen3-30B-A3B at {args.layers} of 48 layers, beside llama.cpp",
            "",
            f"Machine: {machine_words()}; torch {__import__('torch').__version__}, Python {platform.python_version()}. "
            f"Run started {started}.",
            "",
            f"Checkpoint: **random weights** with Qwen3-30B-A3B's released config and tensor names (bench/real_shapes.py), "
            f"**reduced depth: {args.layers} of 48 decoder layers**, per-layer shape as released"
            + (
                " **but the width cut to the test builder's (--tiny: a pipeline check, not a benchmark)**"
                if args.tiny
                else ""
            )
            + f"; {ckpt_bytes / 1e9:.2f} GB of bf16 safetensors. Random weights route without the locality of a "
            "trained model (consecutive tokens reuse experts far less than a real Qwen3 does), so the disk cell, "
            "the one figure that depends on the cache, is pessimistic.",
            "",
            f"GGUF files: bf16 from llama.cpp's convert_hf_to_gguf.py ({ggufs['bf16'].stat().st_size / 1e9:.2f} GB), "
            "Q8_0 and Q4_0 from it with llama-quantize, twice: the routed experts quantized and every dense tensor kept "
            "bf16 (`--output-tensor-type bf16 --token-embedding-type bf16 --tensor-type attn=bf16`), which is what the "
            "engine's `--expert-quant` does, so equal bits; and llama-quantize's default mix (dense tensors quantized "
            "too, output Q6_K at Q4_0: fewer bytes a token than the engine reads). Sizes: "
            + ", ".join(f"{k} {ggufs[k].stat().st_size / 1e9:.2f} GB" for k in QUANT_TYPES)
            + ". Engine int8: whole-row scales; int4: groups of 64 (llama.cpp's Q8_0 and Q4_0: blocks of 32).",
            "",
            f"Rounds: {args.rounds} measured after a warm-up round, every cell once per round, each engine cell and each "
            f"llama-bench run in a process of its own; ratios are per round, then the median. Decode: {args.tokens} greedy "
            f"tokens after a {DECODE_PROMPT}-token prompt (llama-bench -p 0 -n {args.tokens}), prefill excluded, every "
            f"expert resident. Prefill: a {args.prefill_tokens}-token prompt (llama-bench -p {args.prefill_tokens} -n 0). "
            "llama.cpp: the faster of its mmap and read-into-memory loading modes in each measurement.",
        ]
    )
    lines = [
        "## a. Decode, all resident, equal bits",
        "",
        *render(decode_rows, "tok/s"),
        "",
        "## b. Prefill",
        "",
        *render(prefill_rows, "tok/s"),
        "",
        f"The disk cell: `--offload disk` (uncached O_DIRECT reads from the checkpoint) with the fast tier the memory plan "
        f"gives the **full-depth** checkpoint on this machine: {share['n_slots']} of {share['total_experts']} experts "
        f"({share['share']:.1%}; host budget {share['host_budget'] / 2**30:.1f} GiB, {share['host_source']}), the same "
        f"share applied at {args.layers} layers (`--cache-fraction {share['share']:.4f}`). Prefill chunk: "
        f"`--prefill-token-budget {budget}`"
        + (
            " (the whole prompt in one chunk: a chunk groups its rows per expert, so each expert a layer needs is read "
            "once per chunk, here once for the whole prompt)."
            if budget >= args.prefill_tokens
            else f" ({-(-args.prefill_tokens // budget)} chunks: each expert a layer needs is read once per chunk)."
        )
        + (
            f" In the last round it read {read['bytes'] / 1e9:.2f} GB ({read['misses']} expert loads) in "
            f"{read['seconds']:.1f} s of prefill, at {read['bytes'] / read['transfer_s'] / 1e9:.2f} GB/s per transfer thread "
            "(the bytes over the threads' summed busy time)."
            if read and read["transfer_s"]
            else ""
        ),
        "",
        f"Run as: `{cmd}`. llama.cpp from {src.parent.parent.name}'s vendored tree (GGML_NATIVE build), run as "
        f"`llama-bench -m GGUF -p 0 -n {args.tokens} -t T -r 1 -o json -lm mmap,none` (decode) and "
        f"`llama-bench -m GGUF -p {args.prefill_tokens} -n 0 -t T -r 1 -o json -lm mmap,none` (prefill); GGUF files "
        "made with `convert_hf_to_gguf.py CKPT --outtype bf16` (unknown BPE pre-tokenizer mapped to gpt-2, as in "
        "bench/peers.py) and `llama-quantize [the dense-bf16 flags above] BF16.gguf OUT.gguf Q8_0|Q4_0`. Engine cells: `load_model(CKPT, "
        "EngineConfig(...))` in a spawned process, the fields in the JSON beside this page.",
    ]
    write_report(
        args.out,
        header,
        lines,
        {
            "rounds": res,
            "decode": decode_rows,
            "prefill": prefill_rows,
            "full_depth_plan": share,
            "engine_fields": {
                **{
                    p.name: {"cache_fraction": 1.0, "offload": "ram", "prefix_cache_bytes": 0}
                    | p.engine
                    for p in PAIRS
                },
                "disk": {
                    "cache_fraction": share["share"],
                    "offload": "disk",
                    "dtype": "bfloat16",
                    "prefix_cache_bytes": 0,
                },
            },
            "engine_cells": details,
            "layers": args.layers,
            "tiny": args.tiny,
            "threads": threads,
            "prefill_token_budget": budget,
            "started": started,
        },
    )


if __name__ == "__main__":
    main()
