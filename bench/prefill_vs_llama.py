"""Prompt processing (prefill) tok/s of the engine beside llama.cpp's llama-bench at equal bits.

Cells: f32 (the f32-stored checkpoint, f32 GGUF), bf16 (the bf16-stored checkpoint, bf16 GGUF) and int8
(the bf16 checkpoint with --expert-quant int8 --dense-quant int8, Q8_0 GGUF), each at every --prompts
length, 1 thread. Rounds interleave the two systems cell by cell after a warm-up cell. The engine prefills
the whole prompt in one step (--prefill-token-budget = the prompt) through the batch-invariant native
kernels; llama-bench runs `-p N -n 0 -r 1`. The checkpoints are bench/peers.py's random-weight `mid`
qwen3_moe (hidden 1024, 8 layers, 64 experts, top-8) with a context of 8192; random weights: the routing
is not a trained model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench.peers import checkpoint, convert
from bench.report import machine_line, positive_int, write_report

CHILD = """
import json, sys, time, torch
from engine import CoreLimits, EngineConfig, EngineCore, SamplingParams, complete, load_model
ckpt, quant, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
extra = dict(expert_quant="int8", dense_quant="int8") if quant == "int8" else {}
om = load_model(ckpt, EngineConfig(prefetch="none", **extra))
ids = torch.randint(3, om.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
def once(k):
    core = EngineCore.for_model(om, CoreLimits(max_running=1, prefill_token_budget=k, max_model_len=k + 8))
    c = complete(core, [core.local_request(ids[:k], SamplingParams(max_tokens=1))])[0]
    assert c.error is None, c.error
    return k / c.prefill_seconds
once(n)  # warm-up at the measured length (as llama-bench warms up): first-call checks, buffers of n rows
print("RESULT", json.dumps({"tps": once(n)}))
"""

CELLS = {
    "f32": ("mid-f32", "f32", "none"),
    "bf16": ("mid-bf16", "bf16", "none"),
    "int8": ("mid-bf16", "q8_0", "int8"),
}


def long_context(work: Path, name: str, src: Path) -> Path:
    """A copy of checkpoint `src` (its files linked) whose config allows 8192 positions."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def engine_tps(ckpt: Path, quant: str, n: int) -> float:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(ckpt), quant, str(n)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if "RESULT" not in res.stdout:
        raise SystemExit(
            f"engine cell failed: {(res.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    return float(json.loads(res.stdout.split("RESULT", 1)[1])["tps"])


def llama_tps(bench: Path, gguf: Path, n: int) -> float:
    res = subprocess.run(
        [str(bench), "-m", str(gguf), "-p", str(n), "-n", "0", "-t", "1", "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if res.returncode != 0:
        raise SystemExit(
            f"llama-bench failed: {(res.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    return float(json.loads(res.stdout)[0]["avg_ts"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        required=True,
        help="a llama.cpp source tree with build/bin/llama-bench",
    )
    ap.add_argument("--prompts", default="512,4096", help="prompt lengths (default 512,4096)")
    ap.add_argument("--cells", default="f32,bf16,int8", help="cells: f32, bf16, int8 (default all)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument(
        "--work", type=Path, default=Path(".cache/prefill"), help="where checkpoints and GGUFs go"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="Markdown page to write (JSON beside it)"
    )
    args = ap.parse_args(argv)
    bench = args.llama_cpp / "build" / "bin" / "llama-bench"
    peers = Path(".cache/peers")
    ckpts = {
        "mid-f32": long_context(args.work, "mid-f32", checkpoint(peers, "mid")),
        "mid-bf16": long_context(args.work, "mid-bf16", checkpoint(peers, "mid", torch.bfloat16)),
    }
    cells = [(c, int(n)) for c in args.cells.split(",") for n in args.prompts.split(",")]
    ggufs = {
        c: convert(args.llama_cpp, ckpts[CELLS[c][0]], CELLS[c][1]) for c in {c for c, _ in cells}
    }
    res: dict[str, dict[str, list[float]]] = {
        f"{c} {n}": {"engine": [], "llama": []} for c, n in cells
    }
    engine_tps(ckpts["mid-bf16"], "none", 64)  # warm-up of the machine and the native build
    for r in range(args.rounds):
        for c, n in cells:
            name, _, quant = CELLS[c]
            first = r % 2 == 0  # which system runs first alternates by round
            for system in ("engine", "llama") if first else ("llama", "engine"):
                tps = (
                    engine_tps(ckpts[name], quant, n)
                    if system == "engine"
                    else llama_tps(bench, ggufs[c], n)
                )
                res[f"{c} {n}"][system].append(tps)
                print(f"round {r + 1} {c} {n} {system}: {tps:.1f} tok/s", flush=True)
    lines = [
        "| bits | prompt | engine tok/s | llama.cpp tok/s | engine / llama.cpp (per round) |",
        "|---|---|---|---|---|",
    ]
    for key, v in res.items():
        bits, n = key.split()
        ratios = [e / ll for e, ll in zip(v["engine"], v["llama"], strict=True)]
        lines.append(
            f"| {bits} | {n} | {statistics.median(v['engine']):.1f} | {statistics.median(v['llama']):.1f} | "
            f"{statistics.median(ratios):.2f}× ({', '.join(f'{x:.2f}' for x in ratios)}) |"
        )
    header = (
        f"Command: `python -m bench prefill-vs-llama --llama-cpp LLAMA_CPP --prompts {args.prompts} --rounds {args.rounds}`. "
        f"{machine_line(1)} Random-weight mid qwen3_moe; medians of {args.rounds} interleaved rounds."
    )
    write_report(args.out, header, lines, {"results": res})


if __name__ == "__main__":
    main()
