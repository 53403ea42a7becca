"""The seed pages' section on a real-shape checkpoint with RANDOM WEIGHTS: Qwen3-30B-A3B's layer
shape (hidden 2048, 128 experts of 768, top-8, bf16) at 4 decoder layers, written once by
bench/real_shapes.py into .cache/real/q30-4l (about 6 GB, git-ignored; `--real-shape-dir`).

`python -m bench seed-000 --only-real-shape` (and seed-003, seed-004) measures that seed's designs
on it with the engine and merges them into the page's JSON as `real_shape`; the page renders them
(bench/seed_real_shape_page.py). Random weights route without a trained model's locality, and
their text means nothing: only speed and bytes are measured, never quality.

Every cell: cache 0.25, experts on disk (the engine's disk tier opens the checkpoint with
O_DIRECT, so its reads bypass the page cache: engine/experts/tiers/uncached_io.py; the JSON keeps
the mode each file was opened with), no emulated link, 1 torch thread unless --threads, a 16-token
random prompt (ids the checkpoint's tokenizer knows), greedy tokens with the decode clock started
after the first (bench/spec_bench.py `run_cell`), every cell once per round after a warm-up round
(bench/report.py `interleaved`; round r: every cell on prompt r), medians of per-round ratios to
the section's baseline. Engines are kept across rounds, as a server keeps them.

Seed 003's SpecPrefetch adapter is fitted here once (cached beside the checkpoint) on a trace of
the engine's float32 forward (written when fitting on a bf16 model failed, fixed since in
engine/prefetch/training.py; kept so the cached adapter is the one the page measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import interleaved, machine_line, positive_int, summarize
from bench.seed000_speed import SPEED_POLICIES
from bench.seed004_runs import CONFIGS as SPAC_CONFIGS
from engine import EngineConfig, SpecConfig, portable_path

CKPT = Path(".cache/real/q30-4l")
MODEL, LAYERS = "qwen3-30b-a3b", 4
CACHE = 0.25
PROMPT_TOKENS = 16
PROMPT_VOCAB = 512  # the builder's tokenizer (models/tiny.py make_tokenizer(512)): ids below it
KV_TOKENS = (
    512  # a request needs 16 + tokens + a window: the KV pool stays small beside the experts
)
TRAIN_DATA = "models/embedded/data/valid.txt"

OFF = SpecConfig(speculative="off")
# The n-gram (prompt-lookup) proposer stands in for a draft model: the checkpoint has none, and
# random weights' greedy text repeats, so its proposals are accepted now and then.
NGRAM = SpecConfig(speculative="ngram", num_speculative_tokens=4, adaptive=False)
FATE = "FATE-like (next router on x_l)"
ADAPTER = "SpecPrefetch adapter (fitted here)"
ADAPTED = {"prefetch": "adapter"}
# seed -> label -> (speculation, EngineConfig overrides); the first label is the section's baseline.
SECTIONS: dict[str, dict[str, tuple[SpecConfig, dict[str, Any]]]] = {
    "000": {
        "fetch-all (exact)": (OFF, SPEED_POLICIES["fetch-all"]),
        "0.15 rule": (OFF, SPEED_POLICIES["threshold"]),
        "first-choice rule": (OFF, SPEED_POLICIES["first-choice"]),
        "Quality-First": (OFF, SPEED_POLICIES["quality-first"]),
        "Speed-First": (OFF, SPEED_POLICIES["speed-first"]),
    },
    "003": {"no prefetch": (OFF, {}), FATE: (OFF, ADAPTED), ADAPTER: (OFF, ADAPTED)},
    "004": {
        "plain": (OFF, SPAC_CONFIGS["plain"][1]),
        "plain+cpu": (OFF, SPAC_CONFIGS["plain+cpu"][1]),
        "spec": (NGRAM, SPAC_CONFIGS["spec"][1]),
        "spec+utility+cpu": (NGRAM, SPAC_CONFIGS["spec+utility+cpu"][1]),
    },
}


def add_real_shape_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of the real-shape section, the same on each seed command."""
    add = ap.add_argument
    add(
        "--only-real-shape",
        action="store_true",
        help="measure only the real-shape section (this seed's designs on Qwen3-30B-A3B's layer shape at 4 "
        "layers with RANDOM WEIGHTS, experts read from disk at cache 0.25) and merge it into the JSON beside "
        "--out as real_shape, then rewrite the page; the checkpoint (about 6 GB) is written once if missing",
    )
    add(
        "--real-shape-dir",
        type=Path,
        default=CKPT,
        help=f"the real-shape checkpoint, written there by bench/real_shapes.py if missing (default {CKPT})",
    )
    add(
        "--real-shape-tokens",
        type=positive_int,
        default=32,
        help="real-shape section: greedy tokens per request (default 32)",
    )
    add(
        "--real-shape-rounds",
        type=positive_int,
        default=8,
        help="real-shape section: measured rounds after a warm-up round (default 8)",
    )
    add(
        "--real-shape-note",
        default="",
        help="real-shape section: words added to its Machine line, e.g. 'other work running' (default none)",
    )


def checkpoint(path: Path) -> Path:
    """The real-shape checkpoint, written once (`.complete` marks a finished one)."""
    from bench.real_shapes import write_checkpoint

    if not (path / ".complete").exists():
        write_checkpoint(path, MODEL, LAYERS, shard_bytes=int(4e9))
        (path / ".complete").write_text("")
    return path


def prefetcher_path(ckpt: Path) -> Path:
    """Where the fitted adapter lives: beside the checkpoint, not in it, so no `--prefetch auto`
    engine of another benchmark picks it up."""
    return ckpt.parent / f"{ckpt.name}-prefetcher.safetensors"


def fit_prefetcher(ckpt: Path, tokens: int = 4096, steps: int = 1500) -> dict[str, Any]:
    """SpecPrefetch's adapter for `ckpt` (the shipped form: next router's guess + rank-64 map +
    bias), fitted once on `tokens` tokens of TRAIN_DATA and cached; its file's metadata."""
    from cli.eval import _read_tokens
    from engine import (
        data_from_trace,
        evaluate,
        evaluate_base,
        load_model,
        model_fingerprint,
        record_trace,
        save_adapter,
        train_adapter,
    )

    path = prefetcher_path(ckpt)
    if not path.exists():
        t0 = time.perf_counter()
        cfg = EngineConfig(dtype="float32", cache_fraction=CACHE, offload="disk", prefetch="none")
        om = load_model(ckpt, cfg)
        try:
            ids = _read_tokens(om, TRAIN_DATA, tokens, 256)
            trace = record_trace(om, ids, 256, logits=True, hidden=True)
            fit, held = data_from_trace(trace, om.model, om.moe_layers).split(0.9)
            adapter = train_adapter(fit, 64, steps, valid=held)
            extra = {
                "data": TRAIN_DATA,
                "tokens": len(ids),
                "steps": steps,
                "heldout_recall": statistics.mean(evaluate(adapter, held)),
                "heldout_recall_fate": statistics.mean(evaluate_base(held)),
                "seconds": time.perf_counter() - t0,
            }
            save_adapter(adapter, path, model_fingerprint(om.model), extra)
        finally:
            om.close()
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {})["moe_offload_prefetcher"])


def engine(ckpt: Path, seed: str, label: str) -> Any:
    """The engine of one cell; FATE-like: the adapter's hook with the next router's own guess."""
    from engine import fate_predictor, load_model

    _, over = SECTIONS[seed][label]
    adapted = over.get("prefetch") == "adapter"
    cfg = EngineConfig(
        cache_fraction=CACHE,
        offload="disk",
        kv_tokens=KV_TOKENS,
        prefetcher=str(prefetcher_path(ckpt)) if adapted else None,
        **{"prefetch": "none", **over},
    )
    om = load_model(ckpt, cfg)
    if label == FATE:
        a = om.adapter_prefetcher.adapter
        om.adapter_prefetcher.use_predictor(fate_predictor(a.hidden, a.num_experts, a.anchors))
    return om


def figures(r: dict[str, Any]) -> dict[str, float]:
    """One cell's decode figures from `run_cell`'s result: bench/spac_bench.py's (tok/s, stall
    share, hit rate, prefetch recall, bytes/token, CPU-run experts/token, tokens a verification)
    without prefetch precision (undefined without prefetches), the share of expert calls
    substituted, and the bytes read over the transfer threads' busy time (GB/s)."""
    from bench.spac_bench import spac_figures

    s = r["stats"]
    calls = s["calls_hit"] + s["calls_fetched"] + s["substitutions"]
    out = {k: v for k, v in spac_figures(r).items() if k != "precision"}
    out["substituted_share"] = s["substitutions"] / calls if calls else 0.0
    busy = sum(s["transfer_seconds"].values())  # the transfer threads' summed busy time
    out["read_gb_s"] = s["bytes_moved"] / busy / 1e9 if busy else 0.0
    return out


def rows(res: dict[str, list[dict[str, float]]], baseline: str) -> list[dict[str, Any]]:
    """Per cell: the medians of its figures over the rounds, `ratio` (the median of its per-round
    tok/s over the baseline's in the same round) and those per-round ratios."""
    out = []
    for label, runs in res.items():
        s = summarize(res, label, baseline, list(runs[0]))
        per = [a["tok_s"] / b["tok_s"] for a, b in zip(runs, res[baseline])]
        out.append({"config": label, "ratio": s.pop("ratio"), "round_ratios": per, **s})
    return out


def prompts(n: int, vocab: int) -> list[list[int]]:
    """n random prompts of PROMPT_TOKENS ids in [3, vocab), seeded: the same on every run."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(n)]


def measure(seed: str, ckpt: Path, tokens: int, rounds: int) -> dict[str, Any]:
    """Every cell of SECTIONS[seed] on `ckpt`, side by side in interleaved rounds."""
    from bench.spec_bench import run_cell

    cells = SECTIONS[seed]
    engines = {label: engine(ckpt, seed, label) for label in cells}
    first = next(iter(engines.values()))
    vocab = min(PROMPT_VOCAB, len(first.tokenizer)) if first.tokenizer else PROMPT_VOCAB
    asked, turn = prompts(rounds + 1, vocab), dict.fromkeys(cells, 0)

    def one(label: str) -> dict[str, float]:
        prompt, turn[label] = asked[turn[label]], turn[label] + 1
        return figures(run_cell(engines[label], cells[label][0], [prompt], tokens))

    try:
        res = interleaved(list(cells), rounds, one)
        modes = sorted(
            {m for om in engines.values() for m in om.transfers.tier.reader.modes.values()}
        )
        plan = first.memory_plan
        shape = {
            "layers": len(first.moe_layers),
            "experts": first.num_experts,
            "top_k": first.top_k,
            "n_slots": plan.n_slots,
            "total_experts": plan.total_experts,
            "parameters": first.parameter_count(),
        }
    finally:
        for om in engines.values():
            om.close()
    return {"rows": rows(res, next(iter(cells))), "disk_reads": modes, "shape": shape}


def real_shape_run(seed: str, args: argparse.Namespace) -> dict[str, Any]:
    """The section's JSON: the measured rows, the checkpoint, this run's machine, load and time."""
    t0, load = time.perf_counter(), os.getloadavg()[0]
    ckpt = checkpoint(args.real_shape_dir)
    adapter = fit_prefetcher(ckpt) if seed == "003" else None
    m = measure(seed, ckpt, args.real_shape_tokens, args.real_shape_rounds)
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    return {
        **m,
        "machine": machine_line(args.threads),
        "note": args.real_shape_note,
        "checkpoint": {"model": MODEL, "path": portable_path(ckpt), "bytes": size},
        "cache": CACHE,
        "prompt_tokens": PROMPT_TOKENS,
        "tokens": args.real_shape_tokens,
        "rounds": args.real_shape_rounds,
        "proposer": "n-gram (prompt lookup), k = 4" if seed == "004" else None,
        "adapter": adapter,
        "load_average": {"before": load, "after": os.getloadavg()[0]},
        "seconds": time.perf_counter() - t0,
    }


def merge_real_shape(seed: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """--only-real-shape: the section measured and merged into the JSON beside `out`; the result."""
    result = json.loads(out.with_suffix(".json").read_text())
    result["real_shape"] = real_shape_run(seed, args)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return result


def carry_real_shape(out: Path, result: dict[str, Any]) -> None:
    """A full run of a seed's command does not measure the real-shape section (--only-real-shape
    does): keep the one the JSON beside `out` holds, if any, in the result that replaces it."""
    old = out.with_suffix(".json")
    if "real_shape" not in result and old.exists():
        if (section := json.loads(old.read_text()).get("real_shape")) is not None:
            result["real_shape"] = section
