"""MoE-SpAc on the embedded pair: speculative decoding as a sensor for prefetch, eviction and
CPU-run experts, side by side with plain decoding.

Settings: cache 0.25 with the experts on disk, and the same behind an emulated link (hdd); with
`--settings ram` also the host-memory tier over the machine's real link (PCIe on a GPU box,
see bench/spac_gpu.sh).
Configurations (all exact except the last):
  plain              no speculation, fetch-all, LRU eviction (the baseline)
  plain reuse        the same with reuse-distance eviction (the engine's default for fetch-all)
  spec               speculative decoding (the draft, adaptive k <= 4), LRU
  spec+utility       + utility prefetch and utility eviction
  spec+utility+cpu   + CPU-run experts chosen by the workload balancer (on a CPU-only box the
                     "fast device" is the CPU too: this row shows the path's cost, not its benefit)
  spec+utility+cpu speed-first   + the speed-first miss policy (substitutes misses: not exact)
Each cell runs N concurrent greedy requests; after every request has its first token the clock
and counters start. Per cell: decode tok/s and its ratio to `plain` in the same round, stall
share, hit rate, prefetch precision (used / (used + wasted)) and recall (used / (used + demand loads):
the share of slow-tier experts the layers needed that a prefetch had brought or started), and
expert bytes moved per generated token. Rounds are interleaved after a warm-up round.

    python -m bench.spac_bench --out docs/benchmarks/spac.md
"""

from __future__ import annotations

import argparse

import torch

from bench.report import (
    add_run_flags,
    cut_prompts,
    interleaved,
    machine_line,
    prompts_line,
    summarize,
    write_report,
)
from bench.spec_bench import run_cell
from engine import EngineConfig, SpecConfig, load_model, portable_path
from models import EMBEDDED_TARGET

SPEC = SpecConfig(speculative="draft", num_speculative_tokens=4, adaptive=True)
UTILITY = dict(prefetch="utility", eviction="utility")
CONFIGS: dict[str, tuple[SpecConfig, dict]] = {
    "plain": (SpecConfig(speculative="off"), {"eviction": "lru"}),
    "plain reuse": (SpecConfig(speculative="off"), {}),
    "spec": (SPEC, {"eviction": "lru"}),
    "spec+utility": (SPEC, UTILITY),
    "spec+utility+cpu": (SPEC, {**UTILITY, "cpu_experts": "auto"}),
    "spec+utility+cpu speed-first": (
        SPEC,
        {**UTILITY, "cpu_experts": "auto", "policy": "speed-first"},
    ),
}


def spac_figures(r: dict) -> dict[str, float]:
    s = r["stats"]
    demand = s["transfers"]["demand"]
    return {
        "tok_s": r["tok_s"],
        "stall_share": r["stall_share"],
        "hit_rate": s["hit_rate"],
        # Over the prefetches that resolved in the measured phase (used, or evicted/expired unused).
        "precision": s["prefetch_used"] / (s["prefetch_used"] + s["prefetch_wasted"])
        if s["prefetch_used"] + s["prefetch_wasted"]
        else float("nan"),
        "recall": s["prefetch_used"] / (s["prefetch_used"] + demand)
        if s["prefetch_used"] + demand
        else float("nan"),
        "bytes_per_token": r["bytes_per_token"],
        "cpu_calls_per_token": s["cpu_expert_calls"] / r["produced"],
        "tokens_per_verification": r["tokens_per_verification"],
    }


def _device_name(engines: dict) -> str:
    dev = next(iter(engines.values())).device
    return (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else "no GPU (the fast tier is host memory too)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_flags(ap, prompt_tokens=64, tokens=32, rounds=2, link="hdd")
    ap.add_argument(
        "--streams",
        default="1",
        help="comma-separated concurrency levels (default 1: one user, the seed's setting)",
    )
    ap.add_argument(
        "--cache",
        type=float,
        default=0.25,
        help="fast-tier share of the routed experts (default 0.25)",
    )
    ap.add_argument(
        "--settings",
        default="disk,link",
        help="which settings: ram (host-memory tier, the real link: PCIe on a GPU box), disk, link (disk behind --link). Default disk,link",
    )
    ap.add_argument(
        "--device", default="auto", help="compute device (default auto: CUDA when present)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    all_settings = {
        "ram": (f"cache {args.cache} (ram)", "ram", None),
        "disk": (f"cache {args.cache} (disk)", "disk", None),
        "link": (f"cache {args.cache} (disk + {args.link})", "disk", args.link),
    }
    settings = {all_settings[k][0]: all_settings[k][1:] for k in args.settings.split(",")}
    engines = {
        (s, c): load_model(
            EMBEDDED_TARGET,
            EngineConfig(
                cache_fraction=args.cache,
                offload=offload,
                link=link,
                device=args.device,
                **{"prefetch": "none", **kw},
            ),
        )
        for s, (offload, link) in settings.items()
        for c, (_, kw) in CONFIGS.items()
    }
    tok = next(iter(engines.values())).tokenizer
    streams = [int(x) for x in args.streams.split(",")]
    prompts = cut_prompts(tok, args.data, max(streams), args.prompt_tokens)
    cells = [(s, n, c) for s in settings for n in streams for c in CONFIGS]

    def measure(cell: tuple[str, int, str]) -> dict:
        setting, n, config = cell
        return spac_figures(
            run_cell(engines[(setting, config)], CONFIGS[config][0], prompts[:n], args.tokens)
        )

    res = interleaved(cells, args.rounds, measure)
    for om in engines.values():
        om.close()

    lines = [
        "| setting | streams | config | decode tok/s | × plain | tokens / verification | stall share | hit rate | prefetch precision | prefetch recall | expert MB / token | CPU-run experts / token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for s, n, c in cells:
        row = {
            "setting": s,
            "streams": n,
            "config": c,
            **summarize(res, (s, n, c), (s, n, "plain"), list(res[(s, n, c)][0])),
        }
        ratio = row["ratio"]
        rows.append(row)
        pct = lambda v: "–" if v != v else f"{v:.0%}"  # noqa: E731 - nan: no prefetch in this config
        lines.append(
            f"| {s} | {n} | {c} | {row['tok_s']:.1f} | {ratio:.2f}× | {row['tokens_per_verification']:.2f} | {row['stall_share']:.0%} | "
            f"{row['hit_rate']:.0%} | {pct(row['precision'])} | {pct(row['recall'])} | {row['bytes_per_token'] / 1e6:.2f} | {row['cpu_calls_per_token']:.1f} |"
        )
    header = (
        f"{machine_line(args.threads, _device_name(engines))} Model: the embedded pair ({portable_path(EMBEDDED_TARGET)} + draft). "
        + prompts_line(args.prompt_tokens, args.data, args.tokens, args.rounds, args.link)
    )
    write_report(args.out, header, lines, {"rows": rows})


if __name__ == "__main__":
    main()
