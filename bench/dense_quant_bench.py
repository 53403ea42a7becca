"""Quantized decode at the Qwen3-30B-A3B layer shape beside llama.cpp: int4 experts against Q4_0 at equal
bits (dense tensors bf16 in both), and int8 experts with `--dense-quant int8` against llama-quantize's stock
Q8_0 (every tensor it quantizes Q8_0), from one interleaved run. Random weights (bench/real_shapes.py).

The checkpoint and GGUF files are bench/real_shapes_bench.py's (the same builder and llama-quantize
options), under --work; only the two GGUF kinds measured here are made. Every engine cell runs in a
process of its own with every expert resident (cache 1.0, RAM tier); llama-bench decodes --tokens tokens
(-p 0), the faster of its mmap and read-into-memory modes. Rounds interleave every cell after a warm-up
round (discarded); the table gives per-round ratios and their median.

    python -m bench.dense_quant_bench --layers 4 --work .cache/dqbench --out docs/benchmarks/dense_quant.md
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.real_shapes_files import QUANT_TYPES, build_checkpoint

# (engine cell, its EngineConfig fields, GGUF kind or None (engine alone), label)
CELLS: tuple[tuple[str, dict[str, str], str | None, str], ...] = (
    ("int4", {"expert_quant": "int4"}, "q4_0", "int4 experts / Q4_0 experts (dense bf16 in both)"),
    (
        "int8+dense-int8",
        {"expert_quant": "int8", "dense_quant": "int8"},
        "q8_0-mix",
        "int8 experts + --dense-quant int8 / stock Q8_0 (all tensors)",
    ),
    ("int8", {"expert_quant": "int8"}, None, "int8 experts, dense bf16 (beside int4)"),
)


def gguf(src: Path, ckpt: Path, kind: str) -> Path:
    """The bf16 GGUF from llama.cpp's converter, then `kind` from it with llama-quantize (QUANT_TYPES)."""
    from bench.peers import build_target, convert

    qtype, extra = QUANT_TYPES[kind]
    path = ckpt.parent / f"{ckpt.name}-{kind}.gguf"
    if (
        not path.exists()
    ):  # the bf16 file is only its source: it may be deleted once the kinds exist
        bf16 = convert(src, ckpt, "bf16")
        print(f"llama-quantize {bf16.name} -> {path.name} ...", flush=True)
        tmp = path.with_suffix(".part")
        quantize = build_target(src, "llama-quantize")
        subprocess.run(
            [str(quantize), *extra, str(bf16), str(tmp), qtype],
            check=True,
            capture_output=True,
            timeout=3600,
        )
        tmp.rename(path)
    return path


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
        help="decoder layers of the Qwen3-30B-A3B shape (default 8 of 48)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/dqbench"),
        help="where the checkpoint, GGUF files and quantized-expert cache go (default .cache/dqbench)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        help="a llama.cpp source tree with build/bin/llama-bench (default: find one under --work, else build it there)",
    )
    ap.add_argument(
        "--threads", type=positive_int, default=1, help="threads of every cell (default 1)"
    )
    ap.add_argument(
        "--tokens", type=positive_int, default=32, help="greedy decode tokens a cell (default 32)"
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="measured rounds after one warm-up round (default 3)",
    )
    ap.add_argument(
        "--build-only", action="store_true", help="make the checkpoint and GGUF files, then stop"
    )
    ap.add_argument("--out", type=Path, help="write the markdown table here (and JSON beside it)")
    args = ap.parse_args(argv)

    from bench.peers import find_llama_cpp, llama_bench_tps
    from bench.real_shapes_bench import in_child, paired

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src, why = find_llama_cpp(work, args.llama_cpp)
    if src is None:
        sys.exit(why)
    ckpt = build_checkpoint(work, args.layers, False)
    files = {kind: gguf(src, ckpt, kind) for _, _, kind, _ in CELLS if kind is not None}
    if args.build_only:
        return
    quant_dir = str(work / "quant-cache")
    res: dict[str, list[float]] = {}
    for rnd in range(args.rounds + 1):
        for name, fields, kind, _ in CELLS:
            r = in_child(
                ckpt=str(ckpt),
                fields={
                    "cache_fraction": 1.0,
                    "offload": "ram",
                    "dtype": "bfloat16",
                    "quant_cache_dir": quant_dir,
                }
                | fields,
                threads=[args.threads],
                tokens=args.tokens,
                prefill_tokens=16,
                budget=16,
                decode=True,
                prefill=False,
            )
            e = r["decode"][args.threads]
            print(f"round {rnd}: engine {name} {e:.2f} tok/s", flush=True)
            if rnd:
                res.setdefault(f"engine {name}", []).append(e)
            if kind is not None:
                ll = llama_bench_tps(src, files[kind], args.tokens, args.threads)
                print(f"round {rnd}: llama.cpp {kind} {ll:.2f} tok/s", flush=True)
                if rnd:
                    res.setdefault(f"llama {kind}", []).append(ll)
    lines = [
        "| cell | engine tok/s | llama.cpp tok/s | engine / llama.cpp per round | median ratio |",
        "|---|---|---|---|---|",
    ]
    for name, _, kind, label in CELLS:
        if kind is None:
            continue
        per, med = paired(res[f"engine {name}"], res[f"llama {kind}"])
        lines.append(
            f"| {label} | {statistics.median(res[f'engine {name}']):.2f} | "
            f"{statistics.median(res[f'llama {kind}']):.2f} | {', '.join(f'{x:.2f}' for x in per)} | "
            f"**{med:.2f}×** |"
        )
    per, med = paired(res["engine int4"], res["engine int8"])
    lines += [
        "",
        f"Engine int4 experts / engine int8 experts (dense bf16 in both), per round: "
        f"{', '.join(f'{x:.2f}' for x in per)}; median **{med:.2f}×** "
        f"({statistics.median(res['engine int8']):.2f} tok/s for int8).",
    ]
    cmd = "python -m bench.dense_quant_bench " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    sizes = {k: p.stat().st_size for k, p in files.items()}
    head = [
        f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"{args.layers} layers, random weights; GGUF bytes: "
        + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sizes.items())
        + ")",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
