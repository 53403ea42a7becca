"""Quantized experts on the embedded model: quality, bytes and decode speed, from one run.

1. Quality: teacher-forced perplexity (engine/offline/evaluation.py, one token per step, as
   `moe-offload eval`) on the held-out split, fetch-all at cache 1.0, for the checkpoint's
   bf16 experts and for int8 and int4. Same tokens for all three, so ΔPPL is paired.
2. Speed: one engine per format at --cache-fraction behind each --link (disk tier, fetch-all),
   fed held-out text one token per step; rounds go round-robin across the engines after one
   warm-up round so machine noise spreads evenly. Reports decode tok/s, expert bytes per token
   and stall share.

    python -m bench.quant_bench --out-json docs/benchmarks/quantized.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from cli.eval import _read_tokens
from engine import EngineConfig, ModelRunner, load_model, score_window, teacher_forced_eval, windows
from models import EMBEDDED_TARGET

FORMATS = ("none", "int8", "int4")
LABEL = {"none": "bf16 (checkpoint)", "int8": "int8 g64", "int4": "int4 g64"}


def quality(model: str, data: str, max_tokens: int, window: int, cache_dir: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    ids: list[int] | None = None
    for q in FORMATS:
        om = load_model(
            model,
            EngineConfig(
                cache_fraction=1.0, offload="ram", expert_quant=q, quant_cache_dir=cache_dir
            ),
        )
        try:
            ids = ids or _read_tokens(om, data, max_tokens, window)
            r = teacher_forced_eval(om, ids, window, q)
            out[q] = {
                "ppl": r.ppl,
                "tokens": r.tokens,
                "slot_bytes": om.store.slot_bytes,
                "expert_bytes_on_link": om.transfers.tier.expert_nbytes(om.moe_layers[0], 0),
            }
        finally:
            om.close()
    base = out["none"]["ppl"]
    for q in FORMATS:
        out[q]["dppl_pct"] = 100.0 * (out[q]["ppl"] / base - 1.0)
    return out


def expert_bytes(model: str, cache_dir: str) -> dict[str, int]:
    """Bytes of one expert as stored and moved, per format."""
    out = {}
    for q in FORMATS:
        om = load_model(
            model,
            EngineConfig(
                offload="disk", expert_quant=q, quant_cache_dir=cache_dir, warm_start=False
            ),
        )
        try:
            out[q] = om.transfers.tier.expert_nbytes(om.moe_layers[0], 0)
        finally:
            om.close()
    return out


def speed(
    model: str,
    data: str,
    link: str,
    cache_fraction: float,
    rounds: int,
    tokens: int,
    cache_dir: str,
    budget: str = "experts",
) -> dict[str, dict]:
    """budget "experts": every format keeps the same share of the experts in the fast tier.
    budget "bytes": every format gets the fast-tier bytes that bf16 experts take at `cache_fraction`
    (as on a GPU whose slots hold each format as stored), so smaller experts fit more of them."""
    share = {q: cache_fraction for q in FORMATS}
    if budget == "bytes":
        nbytes = expert_bytes(model, cache_dir)
        share = {q: min(1.0, cache_fraction * nbytes["none"] / nbytes[q]) for q in FORMATS}
    engines = {
        q: load_model(
            model,
            EngineConfig(
                expert_quant=q,
                cache_fraction=share[q],
                offload="disk",
                link=link,
                quant_cache_dir=cache_dir,
                prefetch="none",
            ),
        )
        for q in FORMATS
    }
    try:
        runners = {q: ModelRunner(om) for q, om in engines.items()}  # the runner every client uses
        any_om = engines["none"]
        ids = _read_tokens(any_om, data, (rounds + 1) * (tokens + 1), tokens + 1)
        chunks = windows(ids, tokens + 1)
        tally = {
            q: {"steps": 0, "seconds": 0.0, "bytes": 0, "stall": 0.0, "fetched": 0} for q in FORMATS
        }
        for i, chunk in enumerate(chunks[: rounds + 1]):
            for (
                q,
                om,
            ) in engines.items():  # round-robin: every engine sees the same text in the same round
                before = om.stats.snapshot()
                t0 = time.perf_counter()
                score_window(runners[q], chunk)
                dt = time.perf_counter() - t0
                after = om.stats.snapshot()
                if i == 0:
                    continue  # warm-up round: first-call setup, cold cache
                t = tally[q]
                t["steps"] += len(chunk) - 1
                t["seconds"] += dt
                t["bytes"] += after["bytes_moved"] - before["bytes_moved"]
                t["stall"] += after["stall_seconds"] - before["stall_seconds"]
                t["fetched"] += after["calls_fetched"] - before["calls_fetched"]
        rows = {
            q: {
                "tok_s": t["steps"] / t["seconds"],
                "expert_bytes_per_token": t["bytes"] / t["steps"],
                "stall_share": t["stall"] / t["seconds"],
                "fetched_per_token": t["fetched"] / t["steps"],
                "tokens": t["steps"],
                "cache_fraction": share[q],
            }
            for q, t in tally.items()
        }
        for q in FORMATS:
            rows[q]["speedup_vs_bf16"] = rows[q]["tok_s"] / rows["none"]["tok_s"]
            rows[q]["bytes_reduction_vs_bf16"] = (
                rows["none"]["expert_bytes_per_token"] / rows[q]["expert_bytes_per_token"]
            )
        return rows
    finally:
        for om in engines.values():
            om.close()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(EMBEDDED_TARGET))
    p.add_argument("--data", default="models/embedded/data/test.txt")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=8192,
        help="tokens scored for perplexity (whole windows spread over the file)",
    )
    p.add_argument("--window", type=int, default=256)
    p.add_argument(
        "--links",
        default="hdd,150",
        help="comma-separated links to time behind (names or MBPS[:US])",
    )
    p.add_argument("--cache-fraction", type=float, default=0.25)
    p.add_argument(
        "--rounds", type=int, default=4, help="timed rounds per link, after one warm-up round"
    )
    p.add_argument("--tokens", type=int, default=64, help="decode steps per engine per round")
    p.add_argument(
        "--budget",
        choices=("experts", "bytes"),
        default="experts",
        help="fast-tier budget per format: experts (the same share of experts, default) or bytes (the bytes bf16 takes at --cache-fraction: quantized formats fit more experts)",
    )
    p.add_argument("--skip-quality", action="store_true", help="time only (no perplexity part)")
    p.add_argument("--out-json")
    args = p.parse_args()
    torch.set_num_threads(
        1
    )  # see DESIGN.md section 7: 2-thread runs are erratic on the shared machine
    with tempfile.TemporaryDirectory() as cache_dir:
        t0 = time.perf_counter()
        result = {
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "threads": 1,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            # The embedded model's path relative to the repository: no machine paths in committed results.
            "args": {
                **vars(args),
                "model": os.path.relpath(args.model) if os.path.isabs(args.model) else args.model,
            },
            "quality": None
            if args.skip_quality
            else quality(args.model, args.data, args.max_tokens, args.window, cache_dir),
            "speed": {
                link: speed(
                    args.model,
                    args.data,
                    link,
                    args.cache_fraction,
                    args.rounds,
                    args.tokens,
                    cache_dir,
                    args.budget,
                )
                for link in args.links.split(",")
            },
        }
        result["seconds"] = time.perf_counter() - t0
    print(json.dumps(result, indent=2))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
