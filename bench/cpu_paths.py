"""Is the default the fastest exact path on this CPU? Every `--forward` / `--native-kernels` /
`--native-build` choice against transformers' generate, on the mid-size random checkpoint.

Each cell runs in its own process, loads the model,
warms up with one generate, then times `--tokens` greedy decode tokens `--repeats` times; the best
of those is the cell's figure for the round. Rounds run every cell in turn, alternating the order,
and every ratio is taken within one round (all cells of a round share the machine's load), then the
median over rounds. The report names the CPU, the builds it runs, the build and plan each cell ran,
and the dispatcher's own measurement (engine/native/autotune.py).

Random weights (a benchmark stand-in; weights cannot be downloaded). f32, cache 1.0, RAM tier.
`--stored bf16` stores the checkpoint in bf16, as every released checkpoint is, and still computes in
f32 (transformers widens it at load): the engine then keeps the experts' bf16 bytes and widens them in
registers (EngineConfig.bf16_expert_slots, and bf16_dense for the dense linears), and cells with
`--no-bf16-expert-slots` and `--no-bf16-dense` run beside it.

`--emulate avx2` runs every cell as on a CPU without AVX-512: torch's own kernels, oneDNN and MKL are
capped at AVX2 (their documented environment switches, set for each cell's process), and the engine's
dispatcher measures only the builds an AVX2 CPU runs (EngineConfig.native_build_limit). The memory system
stays this machine's, so the page says the CPU was emulated, not which it was.

    python -m bench.cpu_paths --out docs/benchmarks/cpu_paths.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import write_report

# Each cell's EngineConfig fields beyond cache 1.0 in f32 (the flags it stands for are its name).
CELLS: dict[str, dict[str, Any]] = {
    "transformers generate": {},
    "engine defaults": {},
    "--no-bf16-expert-slots": dict(bf16_expert_slots=False),  # --stored bf16 only
    "--no-bf16-dense": dict(bf16_dense=False),  # --stored bf16 only
    "--native-kernels off": dict(native_kernels="off"),
    "--forward lean": dict(forward="lean", native_kernels="on"),
    "--forward transformers": dict(forward="transformers"),
    "--native-build avx512-bf16": dict(native_kernels="on", native_build="avx512-bf16"),
    "--native-build avx512-vnni": dict(native_kernels="on", native_build="avx512-vnni"),
    "--native-build avx512": dict(native_kernels="on", native_build="avx512"),
    "--native-build avx2": dict(native_kernels="on", native_build="avx2"),
    "--native-build portable": dict(native_kernels="on", native_build="portable"),
}
# --emulate: torch's, oneDNN's and MKL's own switches for the widest instructions they may use.
EMULATE_ENV: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}


def worker(
    ckpt: Path, cell: str, tokens: int, repeats: int, threads: int, emulate: str | None
) -> dict[str, Any]:
    """One cell in this process: its best decode tok/s of `repeats` generates after a warm-up."""
    torch.set_num_threads(threads)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(3, vocab, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    if cell == "transformers generate":
        from transformers import AutoModelForCausalLM

        from bench.engine_bench import hf_decode_tps

        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        hf_decode_tps(hf, prompt, 8)
        return {
            "tps": max(hf_decode_tps(hf, prompt, tokens) for _ in range(repeats)),
            "plan": {},
            "torch_isa": torch.backends.cpu.get_cpu_capability(),
        }
    from engine import EngineConfig, SamplingParams, generate, load_model

    limit = {"native_build_limit": emulate} if emulate else {}
    om = load_model(ckpt, EngineConfig(cache_fraction=1.0, dtype="float32", **limit, **CELLS[cell]))
    try:
        params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
        generate(om, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        runs = [generate(om, prompt, params) for _ in range(repeats)]
        return {
            "tps": max(r.decode_tokens_per_s for r in runs),
            "tokens": runs[0].token_ids,
            "plan": om.plan.to_dict(),
            "torch_isa": torch.backends.cpu.get_cpu_capability(),
        }
    finally:
        om.close()


def run_cell(args: argparse.Namespace, ckpt: Path, cell: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.cpu_paths", f"--worker={cell}", "--checkpoint", str(ckpt)]
    cmd += [
        "--tokens",
        str(args.tokens),
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
    ]
    env = dict(os.environ)
    if args.emulate:
        cmd += ["--emulate", args.emulate]
        env.update(EMULATE_ENV[args.emulate])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out.get("tps", 0) <= 0:
        return {"error": f"no tokens decoded: {out}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tokens", type=int, default=64, help="decode tokens per generate (default 64)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed generates per cell and round; the best counts (default 3)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every cell (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/peers"),
        help="where the checkpoint is built (default .cache/peers)",
    )
    ap.add_argument(
        "--stored",
        choices=("f32", "bf16"),
        default="f32",
        help="the checkpoint's stored dtype; every cell computes in f32 (default f32; bf16: as released checkpoints are)",
    )
    ap.add_argument(
        "--emulate",
        choices=tuple(EMULATE_ENV),
        help="run every cell as on a CPU with at most these instructions: torch, oneDNN and MKL capped by their own switches, the engine by --native-build-limit (default: this CPU as it is)",
    )
    ap.add_argument("--out", type=Path, help="write the report (Markdown, and JSON beside it) here")
    ap.add_argument(
        "--cells", help="comma-separated cell names to run (default: every cell this CPU can run)"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one cell, in a child process
    ap.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(
            json.dumps(
                worker(
                    args.checkpoint,
                    args.worker,
                    args.tokens,
                    args.repeats,
                    args.threads,
                    args.emulate,
                )
            )
        )
        return

    from bench.peers import SHAPES, checkpoint
    from engine import cpu_flags, cpu_model, runnable

    stored = torch.bfloat16 if args.stored == "bf16" else torch.float32
    ckpt = checkpoint(args.work, "mid", stored)
    builds = [v.name for v in runnable(limit=args.emulate or "auto")]
    cells = [c for c in CELLS if not c.startswith("--native-build") or c.split()[-1] in builds]
    if args.stored == "f32":  # the same weights as the defaults'
        cells = [c for c in cells if c not in ("--no-bf16-expert-slots", "--no-bf16-dense")]
    if args.cells:
        cells = [c for c in cells if c in args.cells.split(",")]
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in cells}
    t0 = time.time()
    for rnd in range(args.rounds):
        order = cells if rnd % 2 == 0 else cells[::-1]
        for cell in order:
            print(f"round {rnd + 1}/{args.rounds}: {cell} ...", flush=True)
            res[cell].append(run_cell(args, ckpt, cell))

    def ratio(a: str, b: str) -> float:
        pairs = [(x["tps"], y["tps"]) for x, y in zip(res[a], res[b]) if "tps" in x and "tps" in y]
        return statistics.median(x / y for x, y in pairs) if pairs else float("nan")

    # Tokens are compared with torch's own path; without that cell in --cells, with none.
    off = res.get("--native-kernels off", [])
    reference = next((r["tokens"] for r in off if "tokens" in r), None)
    lines = [
        "| cell | build / forward it ran | decode tok/s per round | × transformers | × fastest engine choice | tokens = --native-kernels off |",
        "|---|---|---|---|---|---|",
    ]
    engine_cells = [c for c in cells if c != "transformers generate"]
    fastest = max(engine_cells, key=lambda c: statistics.median(r.get("tps", 0.0) for r in res[c]))
    for c in cells:
        rs = res[c]
        plan: dict[str, Any] = next((r["plan"] for r in rs if r.get("plan")), {})
        ran = (
            f"{plan['forward']['chosen']}; native {plan['native kernels']['chosen']}"
            + (
                f" (build {build.group(1)})"
                if (build := re.search(r"build (\S+)", plan["native kernels"]["why"]))
                and plan["native kernels"]["chosen"] == "on"
                else ""
            )
            if plan
            else (
                "transformers"
                if c == "transformers generate"
                else "; ".join(r.get("error", "") for r in rs)
            )
        )
        same = (
            ""
            if c == "transformers generate" or reference is None
            else ("yes" if all(r.get("tokens") == reference for r in rs) else "**no**")
        )
        per_round = ", ".join(f"{r['tps']:.1f}" if "tps" in r else "failed" for r in rs)
        lines.append(
            f"| {c} | {ran} | {per_round} | "
            f"{ratio(c, 'transformers generate'):.2f}× | {ratio(c, fastest):.2f}× | {same} |"
        )
    default_plan: dict[str, Any] = next(
        (r["plan"] for r in res["engine defaults"] if r.get("plan")), {}
    )
    measured = default_plan.get("native kernels", {}).get("why", "")
    lines += [
        "",
        f"Fastest engine choice this run: **{fastest}**. The default: **{ratio('engine defaults', 'transformers generate'):.2f}×** transformers, "
        f"**{ratio('engine defaults', fastest):.2f}×** the fastest choice.",
        "",
        f"The dispatcher's line for the default cell: `native kernels: {default_plan.get('native kernels', {}).get('chosen', '?')}: {measured}`",
    ]
    flags = cpu_flags()
    isa = ", ".join(
        f
        for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
        if f in flags
    )
    s = SHAPES["mid"]
    torch_isa = sorted({r["torch_isa"] for rs in res.values() for r in rs if "torch_isa" in r})
    emulated = (
        f" **Emulated {args.emulate}-only CPU**: torch's kernels ran at {'/'.join(torch_isa)} (its own report); every cell ran with {', '.join(f'{k}={v}' for k, v in EMULATE_ENV[args.emulate].items())} "
        f"and the engine with `--native-build-limit {args.emulate}`; the memory system is this CPU's."
        if args.emulate
        else ""
    )
    header = (
        f"CPU: {cpu_model()} ({isa}; builds the cells may run: {', '.join(builds)}), {platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} thread(s). Checkpoint: random qwen3_moe 'mid' (hidden {s['hidden']}, {s['num_layers']} layers, "
        f"{s['num_experts']} experts, top-{s['num_experts_per_tok']}, moe_intermediate {s['moe_intermediate_size']}; random weights, "
        f"a benchmark stand-in), stored in {args.stored}, computed in f32, cache 1.0, RAM tier. {args.tokens} greedy decode tokens a generate, the best of {args.repeats} "
        f"after a warm-up, each cell in its own process; {args.rounds} rounds in alternating order ({time.time() - t0:.0f} s)."
        + emulated
    )
    write_report(args.out, header, lines, {"rounds": res, "fastest": fastest})


if __name__ == "__main__":
    main()
