"""Seed 004 (MoE-SpAc: speculative decoding as a sensor for expert prefetch, eviction and CPU-run
experts), its tables and ablations run on this project's embedded pair:
`python -m bench seed-004` regenerates docs/seeds/004-spac.md, its JSON and plots.

MEASURED (the engine, interleaved rounds on this machine): every configuration and ablation at
cache 0.25 behind the emulated link, the fixed-threshold balancer against the optimized τ,
prefetch and eviction apart, the same pair in RAM beside llama-server with and without its draft
(`-md`, with --llama-cpp), the cache-ratio sweep (0.1-0.75), long generations of up to 4000
tokens on the long-context pair (models/embedded/long), and the exact configurations on greedy and
on seeded sampled text (`--only-long` and `--only-sampled` measure one section alone and merge it
into the JSON beside --out; `--only-real-shape` measures plain, CPU-run experts and speculation
with the n-gram proposer standing in for the draft on a RANDOM-WEIGHT checkpoint of
Qwen3-30B-A3B's layer shape, bench/seed_real_shape.py).
SIMULATED (engine/offline/, the router trace of the embedded model): the same configurations on
this machine's profile, PROJECTED onto the paper's hardware and model, and the crossover grid
(expert load time x compute per extra window row) that says where speculation would pay.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import add_common_flags, cut_prompts, machine_line, positive_int
from bench.seed004_page import render, write_plots
from bench.seed_real_shape import add_real_shape_flags, carry_real_shape, merge_real_shape
from engine import costs_for, load_trace

OUT = Path("docs/seeds/004-spac.md")
# The long-context pair (models/embedded/long), as a path from the repository root.
LONG_MODEL = "models/embedded/long/target"


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def panels(text: str) -> list[tuple[float, str]]:
    return [(float(d), a) for d, a in (p.split(":") for p in text.split(","))]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add(
        "--data",
        default="models/embedded/data/test.txt",
        help="text the prompts are cut from (default: the test split)",
    )
    add("--prompt-tokens", type=positive_int, default=64, help="tokens per prompt (default 64)")
    add(
        "--tokens",
        type=positive_int,
        default=64,
        help="tokens per request, main table and sampled-text section (default 64)",
    )
    add(
        "--rounds",
        type=positive_int,
        default=2,
        help="measured rounds after a warm-up round (default 2)",
    )
    add(
        "--link",
        default="hdd",
        help="emulated link in front of the disk tier (default hdd: 150 MB/s, 8 ms a load)",
    )
    add(
        "--cache", type=float, default=0.25, help="fast-tier share of the main table (default 0.25)"
    )
    add(
        "--caches",
        type=floats,
        default=[0.1, 0.25, 0.5, 0.75],
        help="cache-ratio sweep (default 0.1,0.25,0.5,0.75)",
    )
    add(
        "--sweep-tokens",
        type=positive_int,
        default=32,
        help="greedy tokens per request in the sweep (default 32)",
    )
    add(
        "--long",
        type=ints,
        default=[64, 512, 1024, 2048, 4000],
        help="generation lengths measured (default 64,512,1024,2048,4000; prompt + length must fit "
        "the --long-model's context with room for a last k = 4 window)",
    )
    add(
        "--long-model",
        default=LONG_MODEL,
        help=f"the target the long generations run on, its draft the sibling draft/ (default "
        f"{LONG_MODEL}: the embedded pair fine-tuned on 4096-token windows, context 4096)",
    )
    add(
        "--long-rounds",
        type=positive_int,
        default=1,
        help="measured rounds of the long generations (default 1)",
    )
    add(
        "--llama-cpp",
        type=Path,
        help="a llama.cpp source tree with build/bin/llama-server and convert_hf_to_gguf.py (without it: no llama-server rows)",
    )
    add(
        "--work",
        type=Path,
        default=Path(".cache/seed004"),
        help="where the GGUF files and server logs go (default .cache/seed004)",
    )
    add(
        "--trace",
        default="docs/benchmarks/embedded_test_trace.npz",
        help="router trace of the embedded model for the simulator (default: the test-split trace)",
    )
    add(
        "--sim-tokens",
        type=positive_int,
        default=512,
        help="tokens per simulated cell on this machine's profile (default 512)",
    )
    add(
        "--long-sim",
        type=ints,
        default=[512, 1024, 2048, 4096],
        help="simulated generation lengths (default 512,1024,2048,4096)",
    )
    add(
        "--profile",
        default="rtx4090-pcie4",
        help="hardware profile of the projection (default rtx4090-pcie4, the paper's GPU)",
    )
    add(
        "--shape",
        default="qwen3-30b-a3b",
        help="model shape of the projection (default qwen3-30b-a3b, the paper's model)",
    )
    add(
        "--proj-tokens",
        type=positive_int,
        default=64,
        help="tokens per projected cell (default 64: utility eviction replays slowly on 48 layers)",
    )
    add(
        "--grid-loads",
        type=floats,
        default=[0.05, 0.3, 1.0, 3.0, 8.33, 30.0],
        help="crossover: ms per expert load (default 0.05,0.3,1,3,8.33,30)",
    )
    add(
        "--grid-rows",
        type=floats,
        default=[0.0, 0.25, 0.5, 1.0],
        help="crossover: an extra row's compute over the first row's (default 0,0.25,0.5,1)",
    )
    add(
        "--grid-panels",
        type=panels,
        default=[(1.0, "bench"), (1.0, "0.87"), (0.1, "bench")],
        help="crossover panels, DRAFT:ACCEPTANCE,...: the draft's cost per token times the measured one, and the "
        "acceptance (bench: the spec benchmark's measured rates, about 1.9 tokens a verification; a number a: "
        "P(run >= i) = a**i, 0.87 giving this page's 3.9). Default 1:bench,1:0.87,0.1:bench",
    )
    add(
        "--grid-tokens",
        type=positive_int,
        default=256,
        help="tokens per crossover cell (default 256)",
    )
    add(
        "--sampled-data",
        type=lambda t: t.split(","),
        default=["models/embedded/data/test.txt", "models/embedded/data/test_pydocs.txt"],
        help="texts the sampled-text section's prompts are cut from, comma-separated (default: the test "
        "split and its Python-docs half)",
    )
    add(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature of the sampled-text section (default 0.8; each request seeded)",
    )
    add(
        "--only-long",
        action="store_true",
        help="measure only the long generations (and llama-server -md on the long pair, with "
        "--llama-cpp) and merge them into the JSON beside --out, then rewrite the page",
    )
    add(
        "--only-sampled",
        action="store_true",
        help="measure only the sampled-text section (greedy and seeded sampling, the exact configurations "
        "and spec+cpu without utility) and merge it into the JSON beside --out, then rewrite the page",
    )
    add("--no-measure", action="store_true", help="simulate only (the smoke test's setting)")
    add(
        "--measured-from",
        type=Path,
        help="measure nothing: take the measured tables from this earlier JSON and simulate again",
    )
    add(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite the page and plots from the JSON beside --out",
    )
    add_real_shape_flags(ap)
    add_common_flags(ap, f"write the page here (default {OUT}; JSON and plots beside it)")
    return ap.parse_args()


def simulated(args: argparse.Namespace) -> dict:
    from bench.seed004_sim import (
        NON_SPEC,
        SIM_CONFIGS,
        acceptance_for,
        cache_sweep,
        config_table,
        crossover,
        long_generation,
        projected_costs,
    )

    trace = load_trace(args.trace)
    here = costs_for("this-machine-disk-hdd", "embedded", trace["meta"]["expert_nbytes"])
    pt, pc = projected_costs(trace, args.profile, args.shape)
    labels = [lb for lb in SIM_CONFIGS if lb != "plain"]
    sweep = (*NON_SPEC[1:], "spec", "spec+utility+cpu")
    grid = (args.grid_loads, args.grid_rows, args.grid_panels)
    return {
        "here": config_table(trace, here, labels, args.cache, args.sim_tokens),
        "here_high": config_table(
            trace, here, labels, args.cache, args.sim_tokens, acceptance=acceptance_for("0.87")
        ),
        "projected": config_table(pt, pc, labels, args.cache, args.proj_tokens),
        "projected_sweep": cache_sweep(pt, pc, sweep, args.caches, args.proj_tokens),
        "long": long_generation(
            trace, here, ("plain reuse", "spec", "spec+utility+cpu"), args.long_sim, args.cache
        ),
        "crossover": crossover(trace, here, *grid, args.cache, args.grid_tokens),
        "here_costs": {"load_ms": here.copy_seconds() * 1e3, "draft_ms": here.draft_token_s * 1e3},
        "trace_tokens": int(trace["ids"].shape[0]),
    }


def _prompts(args: argparse.Namespace, data: str) -> list[list[int]]:
    """The prompts cut from `data`, the same ones in every section (round r uses prompt r)."""
    from transformers import AutoTokenizer

    from models import EMBEDDED_TARGET

    tok = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)
    return cut_prompts(tok, data, max(args.rounds, args.long_rounds) + 1, args.prompt_tokens)


def sampled(args: argparse.Namespace) -> list[dict]:
    from bench.seed004_runs import sampled_table

    return sampled_table(args, {t: _prompts(args, t) for t in args.sampled_data})


def only_section(args: argparse.Namespace, out: Path, key: str, measure: Any) -> dict:
    """--only-sampled / --only-long: one section measured alone (`measure(args)`) and merged into
    the JSON of a full run as measured[key], with this run's machine, arguments and time as
    `{key}_run`."""
    result = json.loads(out.with_suffix(".json").read_text())
    t0 = time.perf_counter()
    result["measured"][key] = measure(args)
    result[f"{key}_run"] = {
        "machine": machine_line(args.threads),
        "args": recorded_args(args),
        "seconds": time.perf_counter() - t0,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return result


def llama_servers(args: argparse.Namespace, target: Path, work: Path, tokens: int) -> Any:
    """llama-server without and with the draft (target's sibling draft/) for requests of up to
    `tokens` tokens, or None without --llama-cpp."""
    if args.llama_cpp is None:
        return None
    from bench.seed004_llama import LlamaServers, gguf_pair

    ggufs = gguf_pair(args.llama_cpp, target, target.parent / "draft", work)
    return LlamaServers(args.llama_cpp, ggufs, args.prompt_tokens + tokens + 16, args.threads, work)


def long_measured(args: argparse.Namespace) -> list[dict]:
    """The long generations on --long-model, beside llama-server -md on the same pair."""
    from bench.seed004_runs import long_runs

    llama = llama_servers(args, Path(args.long_model), args.work / "long", max(args.long))
    try:
        return long_runs(args, _prompts(args, args.data), llama)
    finally:
        if llama is not None:
            llama.close()


def measured(args: argparse.Namespace) -> dict:
    from bench.seed004_runs import main_table, sweep_table
    from models import EMBEDDED_TARGET

    prompts = _prompts(args, args.data)
    llama = llama_servers(args, Path(EMBEDDED_TARGET), args.work, args.tokens)
    try:
        tables = {
            "main": main_table(args, prompts, llama),
            "sweep": sweep_table(args, prompts),
        }
    finally:
        if llama is not None:
            llama.close()
    return {
        **tables,
        "long": long_measured(args),
        "sampled": sampled(args),
        "llama": llama is not None,
    }


def recorded_args(args: argparse.Namespace) -> dict[str, str]:
    """The arguments as the JSON keeps them: a llama.cpp tree is this machine's path, so only
    whether one was given ("DIR") is kept."""
    out = {k: str(v) for k, v in vars(args).items()}
    if args.llama_cpp is not None:
        out["llama_cpp"] = "DIR"
    return out


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or OUT
    if args.render_only:
        result = json.loads(out.with_suffix(".json").read_text())
    elif args.only_sampled:
        result = only_section(args, out, "sampled", sampled)
    elif args.only_long:
        result = only_section(args, out, "long", long_measured)
    elif args.only_real_shape:
        result = merge_real_shape("004", args, out)
    else:
        t0 = time.perf_counter()
        result = {
            "machine": machine_line(args.threads),
            "args": recorded_args(args),
            "measured": {} if args.no_measure or args.measured_from else measured(args),
        }
        if args.measured_from is not None:  # keep an earlier run's measurements, simulate again
            earlier = json.loads(args.measured_from.read_text())
            result.update(machine=earlier["machine"], measured=earlier["measured"])
            result["measured_args"] = earlier.get("measured_args", earlier["args"])
            result["measured_seconds"] = earlier.get("measured_seconds", 0.0)
        else:
            result["measured_seconds"] = time.perf_counter() - t0
            result["measured_args"] = result["args"]
        out.parent.mkdir(parents=True, exist_ok=True)
        carry_real_shape(out, result)
        # Written once measured, again once simulated: a failed simulation keeps the measurements.
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        t1 = time.perf_counter()
        result["simulated"] = simulated(args)
        result["simulated_seconds"] = time.perf_counter() - t1
        result["seconds"] = result["measured_seconds"] + result["simulated_seconds"]
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_plots(result, out)
    out.write_text(render(result, out))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
