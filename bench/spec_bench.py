"""Speculative decoding on the embedded pair, side by side with plain decoding.

Settings: cache 1.0 (RAM), cache 0.25 (disk), cache 0.25 (disk behind an emulated link).
Configurations: off; draft with k = 2, 4, 6 (fixed); draft with adaptive k (k <= 4); n-gram (k <= 4).
Each cell runs N concurrent greedy requests (N from --streams) through one in-process engine
core. After every request has its first token the clock and counters start; the cell reports
aggregate decode tok/s (and its ratio to `off` in the same round), tokens per verification
(accepted + 1), acceptance per position, distinct experts per verification window against
the top-k of a single token, expert bytes moved per generated token, and the stall share.
Rounds are interleaved (every cell once per round) after a warm-up round.

    python -m bench.spec_bench --out docs/benchmarks/speculative.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

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
from engine import (
    CoreLimits,
    EngineConfig,
    EngineCore,
    SamplingParams,
    SpecConfig,
    load_model,
    make_speculation,
    portable_path,
)
from models import EMBEDDED_TARGET

CONFIGS = {
    "off": SpecConfig(speculative="off"),
    "draft k=2": SpecConfig(speculative="draft", num_speculative_tokens=2, adaptive=False),
    "draft k=4": SpecConfig(speculative="draft", num_speculative_tokens=4, adaptive=False),
    "draft k=6": SpecConfig(speculative="draft", num_speculative_tokens=6, adaptive=False),
    "draft adaptive (k<=4)": SpecConfig(
        speculative="draft", num_speculative_tokens=4, adaptive=True
    ),
    "ngram (k<=4)": SpecConfig(speculative="ngram", num_speculative_tokens=4, adaptive=True),
}


_SPECULATION: dict[tuple[int, SpecConfig], tuple] = {}


def speculation_for(om, spec: SpecConfig) -> tuple:
    """One proposer per engine and configuration, kept across rounds as a server keeps it: what
    adaptive k learns about costs in the warm-up round carries into the measured rounds."""
    key = (id(om), spec)
    if key not in _SPECULATION:
        _SPECULATION[key] = make_speculation(spec.resolve(EMBEDDED_TARGET), om)
    return _SPECULATION[key]


def _checked(outputs: list) -> list:
    """A step's outputs; a request that failed stops the cell (it would never produce a token)."""
    for o in outputs:
        if o.error:
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
    return outputs


def run_cell(
    om,
    spec: SpecConfig,
    prompts: list[list[int]],
    tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """The prompts decoded together (greedy, or sampled at `temperature` with every request seeded
    `seed`): decode-phase figures, and each request's generated token ids."""
    proposer, observers = speculation_for(om, spec)
    context = int(getattr(om.config, "max_position_embeddings", None) or 2048)
    core = EngineCore.for_model(
        om,
        CoreLimits(max_running=len(prompts), prefill_token_budget=4096, max_model_len=context),
        proposer,
        observers,
    )
    params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=seed, ignore_eos=True)
    for p in prompts:
        core.add(core.local_request(p, params))
    ids: dict[str, list[int]] = {}
    while len(ids) < len(prompts):
        for o in _checked(core.step()):
            if o.token_ids:
                ids.setdefault(o.request_id, []).extend(o.token_ids)
    om.stats.reset()
    t0, produced = time.perf_counter(), 0
    while core.has_work():
        for o in _checked(core.step()):
            produced += len(o.token_ids)
            ids.setdefault(o.request_id, []).extend(o.token_ids)
    wall = time.perf_counter() - t0
    if short := [len(v) for v in ids.values() if len(v) < tokens]:  # only the context stops one
        raise RuntimeError(
            f"a request stopped after {min(short)} of {tokens} tokens: prompt + tokens exceed "
            f"the model's {context}-token context"
        )
    s = om.stats.snapshot()
    per_layer = [
        r["distinct_experts_per_window"] for r in s["per_layer"] if r["distinct_experts_per_window"]
    ]
    return {
        "tok_s": produced / wall,
        "tokens_per_verification": (s["spec_accepted_tokens"] / s["spec_drafts"] + 1)
        if s["spec_drafts"]
        else 1.0,
        "acceptance_by_position": s["spec_acceptance_by_position"],
        "distinct_per_window": statistics.mean(per_layer) if per_layer else float(om.top_k),
        "bytes_per_token": s["bytes_moved"] / produced,
        "stall_share": s["stall_seconds"] / wall,
        "produced": produced,
        "stats": s,  # the whole decode-phase snapshot, for benchmarks that report more
        "token_ids": list(ids.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_flags(ap, prompt_tokens=64, tokens=32, rounds=2, link="hdd")
    ap.add_argument(
        "--streams", default="1,8", help="comma-separated concurrency levels (default 1,8)"
    )
    ap.add_argument(
        "--settings", default="ram,disk,link", help="which settings to run (default ram,disk,link)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    all_settings = {
        "ram": ("cache 1.0 (ram)", EngineConfig(cache_fraction=1.0)),
        "disk": (
            "cache 0.25 (disk)",
            EngineConfig(cache_fraction=0.25, offload="disk", prefetch="none"),
        ),
        "link": (
            f"cache 0.25 (disk + {args.link})",
            EngineConfig(cache_fraction=0.25, offload="disk", link=args.link, prefetch="none"),
        ),
    }
    settings = dict(all_settings[s] for s in args.settings.split(","))
    engines = {name: load_model(EMBEDDED_TARGET, cfg) for name, cfg in settings.items()}
    tok = next(iter(engines.values())).tokenizer
    streams = [int(x) for x in args.streams.split(",")]
    prompts = cut_prompts(tok, args.data, max(streams), args.prompt_tokens)
    cells = [(s, n, c) for s in settings for n in streams for c in CONFIGS]

    def measure(cell: tuple[str, int, str]) -> dict:
        setting, n, config = cell
        return run_cell(engines[setting], CONFIGS[config], prompts[:n], args.tokens)

    res = interleaved(cells, args.rounds, measure)
    for om in engines.values():
        om.close()

    lines = [
        "| setting | streams | config | decode tok/s | × off | tokens / verification | acceptance by position | distinct experts / window (1 token: top-8) | expert MB / token | stall share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for s, n, c in cells:
        keys = (
            "tok_s",
            "tokens_per_verification",
            "distinct_per_window",
            "bytes_per_token",
            "stall_share",
        )
        row = {
            "setting": s,
            "streams": n,
            "config": c,
            **summarize(res, (s, n, c), (s, n, "off"), keys),
            "acceptance_by_position": res[(s, n, c)][-1]["acceptance_by_position"],
        }
        ratio = row["ratio"]
        rows.append(row)
        acc = " / ".join(f"{a:.2f}" for a in row["acceptance_by_position"]) or "–"
        lines.append(
            f"| {s} | {n} | {c} | {row['tok_s']:.1f} | {ratio:.2f}× | {row['tokens_per_verification']:.2f} | {acc} | "
            f"{row['distinct_per_window']:.1f} | {row['bytes_per_token'] / 1e6:.2f} | {row['stall_share']:.0%} |"
        )
    header = (
        f"{machine_line(args.threads)} Model: the embedded pair ({portable_path(EMBEDDED_TARGET)} + draft). "
        + prompts_line(args.prompt_tokens, args.data, args.tokens, args.rounds, args.link)
        + " Acceptance by position is from the last round."
    )
    write_report(args.out, header, lines, {"rows": rows})


if __name__ == "__main__":
    main()
