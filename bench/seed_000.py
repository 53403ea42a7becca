"""Seed 000 (substitution and caching), its tables and ablations run on this project's model:
`python -m bench seed-000` regenerates docs/seeds/000-substitution.md, its JSON and plots.

Quality (teacher-forced perplexity, deterministic, prefetch off): the policy table, experiment B
(a few heavy substitutions against many light ones at equal substituted mass), the protection
contrast at matched substitution shares, background admission with the eviction held fixed, a text
that switches domain mid-way, and the mass hypothesis. Speed: the policies measured side by side in
one interleaved run on the emulated slow link, and the router-trace simulator's projection onto the
paper's hardware and model (labelled simulated / projected). `--only-real-shape` measures the
policies' speed on a RANDOM-WEIGHT checkpoint of Qwen3-30B-A3B's layer shape
(bench/seed_real_shape.py) and merges it into the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.policy_bench import workload
from bench.report import add_common_flags, machine_line, positive_int
from bench.seed000_contrast import contrasts, only_contrast, protected_rows, router_trace
from bench.seed000_experiments import (
    admission_tables,
    experiment_b,
    mass_hypothesis,
    policy_table,
    rows,
    topic_shift,
)
from bench.seed000_generation import generation_test
from bench.seed000_page import render, write_plots
from bench.seed000_runs import Setup, shift_windows, spread_windows, tokenize
from bench.seed000_speed import measured_speed, projected_speed
from bench.seed000_stats import normalized_gates
from bench.seed_real_shape import add_real_shape_flags, carry_real_shape, merge_real_shape
from engine import portable_path

DATA = Path("models/embedded/data")


def trace_meta(trace: dict) -> dict:
    return json.loads(str(trace["meta"]))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument(
        "--data",
        default=str(DATA / "test.txt"),
        help="held-out text (default: the embedded test split)",
    )
    ap.add_argument(
        "--cache-fraction",
        type=float,
        default=0.25,
        help="fast-tier share of experts (default 0.25, the paper's)",
    )
    ap.add_argument(
        "--tokens",
        type=positive_int,
        default=2048,
        help="tokens scored per policy, whole windows spread over --data (default 2048)",
    )
    ap.add_argument(
        "--window",
        type=positive_int,
        default=256,
        help="tokens per window; the KV cache restarts each window (default 256)",
    )
    ap.add_argument(
        "--shift",
        default="shakespeare,pydocs",
        metavar="A,B",
        help="topic shift: domain A's test text, then domain B's (files test_A.txt, test_B.txt beside --data; default shakespeare,pydocs)",
    )
    ap.add_argument(
        "--shift-windows",
        type=positive_int,
        default=4,
        help="consecutive windows per domain in the topic-shift text (default 4)",
    )
    ap.add_argument(
        "--shift-window",
        type=positive_int,
        default=128,
        help="tokens per topic-shift window (default 128)",
    )
    ap.add_argument(
        "--shift-first",
        type=positive_int,
        default=1,
        help="windows counted as 'right after the shift' (default 1)",
    )
    ap.add_argument(
        "--match-tolerance",
        type=float,
        default=0.01,
        help="matched contrast: stop when the shares differ by at most this (default 0.01, one point)",
    )
    ap.add_argument(
        "--match-tries",
        type=positive_int,
        default=3,
        help="matched contrast: most runs to find the cutoff (default 3)",
    )
    ap.add_argument(
        "--contrast-cutoffs",
        default="0.15",
        metavar="C,...",
        help="protected cut-offs to match the unprotected rule against (default 0.15; 0.05, 0.10, 0.20, 0.30 are in the table too)",
    )
    ap.add_argument(
        "--link",
        default="hdd",
        help="emulated slow link of the speed run (default hdd: 150 MB/s, 8 ms a load)",
    )
    ap.add_argument(
        "--speed-windows",
        type=positive_int,
        default=4,
        help="rounds of the speed run after its warm-up round, one window each (default 4)",
    )
    ap.add_argument(
        "--speed-window",
        type=positive_int,
        default=96,
        help="tokens per speed-run window (default 96)",
    )
    ap.add_argument(
        "--speed-tokens",
        type=positive_int,
        default=32,
        help="greedy tokens per prompt of the speed run's generate workload (default 32)",
    )
    ap.add_argument(
        "--profile",
        default="rtx3090-pcie4",
        help="hardware profile of the projection (configs/hardware; default rtx3090-pcie4, the paper's GPU)",
    )
    ap.add_argument(
        "--shape",
        default="qwen3-next-80b-a3b",
        help="model shape of the projection (default qwen3-next-80b-a3b, the paper's model)",
    )
    ap.add_argument(
        "--no-speed",
        action="store_true",
        help="skip the measured speed run (the smoke test's setting)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        help="a llama.cpp source tree with build/bin/llama-server and convert_hf_to_gguf.py: adds the 0.15-rule "
        "engine against llama-server at equal memory (without it: no llama.cpp rows)",
    )
    ap.add_argument(
        "--only-llama",
        action="store_true",
        help="run only the llama.cpp comparison (needs --llama-cpp) and merge it into the JSON beside --out",
    )
    ap.add_argument(
        "--only-contrast",
        action="store_true",
        help="run only the protection contrast at --contrast-cutoffs (e.g. 0.12 for the paper's 7.5 %% share) "
        "and merge it into the JSON beside --out (give the --data, --tokens and --window it was made with)",
    )
    ap.add_argument(
        "--gen-prompts",
        type=positive_int,
        default=16,
        help="generation test: held-out prompts of 32 tokens (default 16)",
    )
    ap.add_argument(
        "--gen-tokens",
        type=positive_int,
        default=64,
        help="generation test: greedy tokens per prompt and policy (default 64)",
    )
    ap.add_argument(
        "--only-generation",
        action="store_true",
        help="run only the generation test (each policy's greedy text against fetch-all's) and merge it into "
        "the JSON beside --out",
    )
    ap.add_argument(
        "--llama-tokens",
        type=positive_int,
        default=64,
        help="greedy tokens per request of the llama.cpp comparison (default 64)",
    )
    ap.add_argument(
        "--llama-rounds",
        type=positive_int,
        default=8,
        help="measured rounds of the llama.cpp comparison after its warm-up round (default 8)",
    )
    ap.add_argument(
        "--llama-ppl-tokens",
        type=positive_int,
        default=384,
        help="tokens scored for llama.cpp's perplexity, one request a token (default 384)",
    )
    ap.add_argument(
        "--llama-ppl-window",
        type=positive_int,
        default=128,
        help="window of the llama.cpp comparison's perplexity (default 128)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/seed000"),
        help="where the GGUF files and llama-server logs go (default .cache/seed000)",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite the page and plots from the JSON beside --out (after editing the page's analysis)",
    )
    add_real_shape_flags(ap)
    add_common_flags(
        ap, "write the page here (default docs/seeds/000-substitution.md; JSON and plots beside it)"
    )
    return ap.parse_args()


def quality(args: argparse.Namespace, setup: Setup) -> dict:
    ids = tokenize(setup.model_dir, args.data)
    chunks = spread_windows(ids, args.tokens, args.window)
    trace = router_trace(setup, chunks, args.window)
    gates = normalized_gates(trace["weights"])
    scored = policy_table(setup, chunks)
    table = rows(scored)
    by = {r["label"]: r for r in table}
    protected, apart = protected_rows(args, setup, chunks, by, scored["fetch-all"])
    contrast = contrasts(args, setup, chunks, gates, protected, scored["fetch-all"])
    a, b = args.shift.split(",")
    data = Path(args.data).parent
    shift_chunks = shift_windows(
        tokenize(setup.model_dir, data / f"test_{a}.txt"),
        tokenize(setup.model_dir, data / f"test_{b}.txt"),
        args.shift_windows,
        args.shift_window,
    )
    return {
        "table": table,
        "contrast": contrast,
        "contrast_protected": apart,  # protected rows of cutoffs the policy table lacks
        "experiment_b": experiment_b(scored),
        "admission": admission_tables(table),
        "shift": {
            "from": a,
            "to": b,
            **topic_shift(setup, shift_chunks, args.shift_windows, args.shift_first),
        },
        "mass": mass_hypothesis(scored, table),
        "trace": trace,
        "tokens": sum(len(c) - 1 for c in chunks),
        "gate_percentiles": {  # normalized gate by router rank: how skewed the routing is
            str(p): [
                round(float(x), 4)
                for x in np.percentile(gates.reshape(-1, gates.shape[-1]), p, axis=0)
            ]
            for p in (10, 50, 90)
        },
        "model_shape": {k: trace_meta(trace)[k] for k in ("moe_layers", "num_experts", "top_k")},
        "windows": len(chunks),
    }


def against_llama(args: argparse.Namespace, setup: Setup) -> dict:
    """The 0.15-rule engine against stock llama.cpp at equal memory (bench/seed000_llama.py)."""
    from transformers import AutoTokenizer

    from bench.report import cut_prompts
    from bench.seed000_llama import LlamaSetup, run

    tok = AutoTokenizer.from_pretrained(setup.model_dir)
    prompts = cut_prompts(tok, args.data, args.llama_rounds + 1, 32)
    windows = spread_windows(
        tokenize(setup.model_dir, args.data), args.llama_ppl_tokens, args.llama_ppl_window
    )
    t0 = time.perf_counter()
    res = run(
        LlamaSetup(
            args.llama_cpp,
            setup.model_dir,
            args.cache_fraction,
            prompts,
            args.llama_tokens,
            args.llama_rounds,
            windows,
            args.work,
            args.threads,
        )  # fmt: skip
    )
    return {
        **res,
        "machine": machine_line(args.threads),
        "args": {k: str(v) for k, v in vars(args).items() if k.startswith("llama_")}
        | {"llama_cpp": "DIR"},  # this machine's path stays out of the JSON
        "seconds": time.perf_counter() - t0,
    }


def main() -> int:
    from cli.common import resolve_model_dir

    args = parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path("docs/seeds/000-substitution.md")
    only = args.only_llama or args.only_contrast or args.only_generation
    if args.only_real_shape:  # measured alone, merged into the JSON; the page is rewritten below
        merge_real_shape("000", args, out)
    if args.render_only or only or args.only_real_shape:
        result = json.loads(out.with_suffix(".json").read_text())
        setup = Setup(Path(resolve_model_dir(args.model)), args.cache_fraction)
        if args.only_llama:
            if args.llama_cpp is None:
                raise SystemExit("--only-llama needs --llama-cpp DIR")
            result["llama"] = against_llama(args, setup)
        if args.only_contrast:
            only_contrast(args, setup, result)
        if args.only_generation:
            result["generation"] = generation_test(args, setup)
        if only:
            out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        write_plots(result, out)
        out.write_text(render(result, out))
        return 0
    setup = Setup(Path(resolve_model_dir(args.model)), args.cache_fraction)
    t0 = time.perf_counter()
    q = quality(args, setup)
    trace = q.pop("trace")
    speed: dict = {}
    if not args.no_speed:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(setup.model_dir)
        chunks, prompts = workload(
            tok, args.data, args.speed_windows, args.speed_window, args.speed_windows
        )
        speed = measured_speed(
            setup.model_dir, args.cache_fraction, args.link, chunks, prompts, args.speed_tokens
        )
    projected = projected_speed(trace, args.profile, args.shape, args.cache_fraction, q["tokens"])
    generation = generation_test(args, setup)
    result = {
        "machine": machine_line(args.threads),
        "model": portable_path(setup.model_dir),
        "data": portable_path(args.data),
        "args": {k: str(v) for k, v in vars(args).items()}
        | ({"llama_cpp": "DIR"} if args.llama_cpp else {}),  # not this machine's path
        "seconds": time.perf_counter() - t0,
        **q,
        "speed": speed,
        "projected": projected,
        "generation": generation,
    }
    if args.llama_cpp is not None:
        result["llama"] = against_llama(args, setup)
    out.parent.mkdir(parents=True, exist_ok=True)
    carry_real_shape(out, result)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_plots(result, out)
    out.write_text(render(result, out))
    print(f"wrote {out} and {out.with_suffix('.json')} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
