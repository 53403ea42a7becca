"""Aggregate decode throughput against the number of concurrent streams, side by side.

For each setting (cache 1.0 in RAM, cache 0.25 on disk, cache 0.25 on disk behind an emulated
link) and each concurrency (1, 4, 8, 16 streams), N greedy requests with distinct prompts are
submitted to one in-process engine core at once, as the server would. Once every request has
its first token (prefill done), the decode clock and the counters start; the cell reports
aggregate decode tok/s, demand loads per generated token and the stall share of wall time.

The bound columns replay the expert accesses recorded during the decode (every MoE layer's
routed experts, in order) against a tier of the same size: Belady's MIN gives the fewest
loads any eviction policy could make on them, so a target below it is out of reach for any
exact policy; plain LRU on the same recording checks that the recording matches the engine.

Rounds are interleaved (every cell once per round, after a warm-up round) and medians of the
per-round figures are reported; ratios are taken within a round, so they share its load.

    python -m bench.concurrency_bench --out docs/benchmarks/concurrency.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from bench.report import add_run_flags, cut_prompts, interleaved, write_report
from cli.common import resolve_model_dir
from engine import (
    CoreLimits,
    EngineConfig,
    EngineCore,
    RoutingEvent,
    SamplingParams,
    flatten,
    load_model,
    lru_loads,
    min_loads,
    portable_path,
)

STREAMS = (1, 4, 8, 16)


def run_cell(om, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    core = EngineCore.for_model(
        om, CoreLimits(max_running=len(prompts), prefill_token_budget=4096, max_model_len=4096)
    )
    reqs = [
        core.local_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts
    ]
    for r in reqs:
        core.add(r)
    started: set[str] = set()
    while len(started) < len(
        reqs
    ):  # prefill (and any decode steps that share them) before the clock
        started |= {o.request_id for o in core.step() if o.token_ids}
    E = om.num_experts
    resident = [
        k
        for k in (layer * E + e for layer in om.moe_layers for e in range(E))
        if om.store.is_resident(k)
    ]
    accesses: list[list[int]] = []

    def record(ev: RoutingEvent) -> None:
        accesses.append([ev.layer * E + e for e in ev.ids.unique().tolist()])

    unsubscribe = om.bus.subscribe(record)
    s0, t0 = om.stats.snapshot(), time.perf_counter()
    produced = 0
    try:
        while core.has_work():
            produced += sum(len(o.token_ids) for o in core.step())
    finally:
        unsubscribe()
    wall = time.perf_counter() - t0
    s1 = om.stats.snapshot()
    cell = {
        "tok_s": produced / wall,
        "demand_per_token": (s1["transfers"]["demand"] - s0["transfers"]["demand"]) / produced,
        "stall_share": (s1["stall_seconds"] - s0["stall_seconds"]) / wall,
        "tokens": produced,
    }
    if om.store.n_slots < len(om.moe_layers) * E:
        seq = flatten(accesses)
        cell["belady_per_token"] = min_loads(seq, om.store.n_slots, resident) / produced
        cell["lru_replay_per_token"] = lru_loads(seq, om.store.n_slots, resident) / produced
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    add_run_flags(ap, prompt_tokens=32, tokens=24, rounds=3, link="hdd")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    settings = {
        "cache 1.0 (ram)": EngineConfig(cache_fraction=1.0, offload="ram"),
        "cache 0.25 (disk)": EngineConfig(cache_fraction=0.25, offload="disk", prefetch="none"),
        f"cache 0.25 (disk + {args.link})": EngineConfig(
            cache_fraction=0.25, offload="disk", link=args.link, prefetch="none"
        ),
    }
    engines = {name: load_model(model_dir, cfg) for name, cfg in settings.items()}
    tok = next(iter(engines.values())).tokenizer
    prompts = cut_prompts(tok, args.data, max(STREAMS), args.prompt_tokens)
    cells = [(s, n) for s in settings for n in STREAMS]
    results = interleaved(
        cells, args.rounds, lambda cell: run_cell(engines[cell[0]], prompts[: cell[1]], args.tokens)
    )
    for om in engines.values():
        om.close()

    def med(s: str, n: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(s, n)])

    def ratio(s: str, n: int, key: str) -> float:  # per-round ratio against 1 stream, then median
        return statistics.median(
            a[key] / b[key] for a, b in zip(results[(s, n)], results[(s, 1)]) if b[key]
        )

    lines = [
        "| setting | streams | aggregate decode tok/s | × 1 stream | demand loads / token | × 1 stream | stall share "
        "| fewest possible loads / token (Belady) | × 1 stream's demand loads | LRU replay / token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for s in settings:
        for n in STREAMS:
            row = {
                "setting": s,
                "streams": n,
                "tok_s": med(s, n, "tok_s"),
                "tok_s_vs_1": ratio(s, n, "tok_s"),
                "demand_per_token": med(s, n, "demand_per_token"),
                "stall_share": med(s, n, "stall_share"),
            }
            row["demand_vs_1"] = (
                ratio(s, n, "demand_per_token") if row["demand_per_token"] else float("nan")
            )
            bound = "| – | – | – |"
            if "belady_per_token" in results[(s, n)][0]:
                row["belady_per_token"] = med(s, n, "belady_per_token")
                row["lru_replay_per_token"] = med(s, n, "lru_replay_per_token")
                # The bound at n streams against what one stream actually needed, per round.
                row["belady_vs_1_demand"] = statistics.median(
                    a["belady_per_token"] / b["demand_per_token"]
                    for a, b in zip(results[(s, n)], results[(s, 1)])
                )
                bound = f"| {row['belady_per_token']:.2f} | {row['belady_vs_1_demand']:.2f}× | {row['lru_replay_per_token']:.2f} |"
            rows.append(row)
            lines.append(
                f"| {s} | {n} | {row['tok_s']:.1f} | {row['tok_s_vs_1']:.2f}× | {row['demand_per_token']:.2f} | "
                f"{row['demand_vs_1']:.2f}× | {row['stall_share']:.0%} {bound}"
            )
    header = (
        f"Machine: {platform.machine()}, {args.threads} torch thread(s), torch {torch.__version__}, Python {platform.python_version()}. "
        f"Model: {portable_path(model_dir)}. Prompts: {args.prompt_tokens} tokens cut from {portable_path(args.data)}; "
        f"{args.tokens} greedy tokens per request; medians of {args.rounds} interleaved rounds after a warm-up round. "
        f"Link `{args.link}` is emulated."
    )
    write_report(
        args.out,
        header,
        lines,
        {"rows": rows, "rounds": {f"{s}|{n}": v for (s, n), v in results.items()}},
    )


if __name__ == "__main__":
    main()
