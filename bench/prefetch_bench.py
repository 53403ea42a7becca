"""SpecPrefetch on the embedded model: how well each predictor guesses layer l+1's experts, and
what the adapter's prefetches do to decode speed.

Part 1 (recall): a router trace of the held-out test split (hidden states and logits), and for
every token and anchor layer l the top-k experts each predictor names for layer l+1:
  adapter     the shipped prefetcher.safetensors (engine/prefetch/adapter.py)
  FATE-like   layer l+1's own router applied to layer l's router input
  frequency   the k experts layer l+1 used most over the previous --freq-window tokens
  utility     the speculative utility estimator's hottest experts of layer l+1, fed one-token
              windows (ties and shortfalls filled by frequency)
recall@k = share of layer l+1's true top-k among the k predicted; with k predictions for k true
experts, precision@k equals recall@k.

Part 2 (speed): decode tok/s with `--prefetch adapter` against without, at cache 0.25 on disk
and behind an emulated link (sdcard), for plain and speculative decoding, interleaved rounds
after a warm-up round; ratios are taken within a round.

    python -m bench.prefetch_bench --out docs/benchmarks/prefetch.md
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, deque
from pathlib import Path

import numpy as np
import torch

from bench.report import (
    add_run_flags,
    cut_prompts,
    interleaved,
    machine_line,
    summarize,
    write_report,
)
from bench.spec_bench import run_cell
from engine import (
    FILE_NAME,
    EngineConfig,
    SpecConfig,
    data_from_trace,
    load_adapter,
    load_model,
    model_fingerprint,
    portable_path,
    predict,
    recall_at_k,
    record_trace,
)
from models import EMBEDDED_TARGET
from policies.utility import SpeculativeUtilityEstimator


def frequency_predictions(ids: np.ndarray, layer: int, k: int, E: int, window: int) -> torch.Tensor:
    """[N, E] scores: use counts of layer `layer` over the previous `window` tokens (recency breaks ties)."""
    recent: deque[list[int]] = deque()
    counts: Counter[int] = Counter()
    out = torch.zeros(ids.shape[0], E)
    for t in range(ids.shape[0]):
        for e, c in counts.items():
            out[t, e] = c
        row = ids[t, layer].tolist()
        recent.append(row)
        counts.update(row)
        if len(recent) > window:
            counts.subtract(recent.popleft())
    return out


def utility_predictions(ids: np.ndarray, layer: int, E: int, freq: torch.Tensor) -> torch.Tensor:
    """[N, E] scores: the estimator's level (fed this layer's one-token windows), frequency breaking ties."""
    est = SpeculativeUtilityEstimator(E)
    out = torch.zeros(ids.shape[0], E)
    for t in range(ids.shape[0]):
        for e in range(E):
            out[t, e] = est.level(layer, e)
        counts = [0] * E
        for e in ids[t, layer].tolist():
            counts[e] += 1
        est.observe({layer: (counts, counts)})
    return out * 1000.0 + freq


def recall_table(args: argparse.Namespace) -> tuple[list[str], dict]:
    om = load_model(EMBEDDED_TARGET, EngineConfig())
    try:
        adapter = load_adapter(EMBEDDED_TARGET / FILE_NAME, model_fingerprint(om.model))
        ids = om.tokenizer(Path(args.data).read_text(encoding="utf-8"))["input_ids"][
            : args.recall_tokens
        ]
        trace = record_trace(om, ids, 256, logits=True, hidden=True)
        data = data_from_trace(trace, om.model, om.moe_layers)
        E, k = om.num_experts, om.top_k
        model_params = om.parameter_count()
    finally:
        om.close()
    rows: dict[str, list[float]] = {
        "adapter": [],
        "FATE-like": [],
        f"frequency (last {args.freq_window} tokens)": [],
        "utility": [],
    }
    for a in range(data.anchors):
        truth = data.true_ids[:, a]
        freq = frequency_predictions(trace["ids"], a + 1, k, E, args.freq_window)
        rows["adapter"].append(recall_at_k(data.ranked(predict(adapter, data, a), a), truth))
        rows["FATE-like"].append(recall_at_k(data.ranked(data.base[:, a], a), truth))
        rows[f"frequency (last {args.freq_window} tokens)"].append(recall_at_k(freq, truth))
        rows["utility"].append(
            recall_at_k(utility_predictions(trace["ids"], a + 1, E, freq), truth)
        )
    layers = [f"layer {a + 1}" for a in range(data.anchors)]
    lines = [
        "| predictor | " + " | ".join(f"recall@{k} {n}" for n in layers) + " | mean |",
        "|---" * (len(layers) + 2) + "|",
    ]
    for name, vals in rows.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{v:.1%}" for v in vals)
            + f" | {statistics.mean(vals):.1%} |"
        )
    share = adapter.trainable_parameters() / model_params
    lines.append("")
    lines.append(
        f"Adapter: rank {adapter.rank}, {adapter.trainable_parameters():,} parameters = {share:.3%} of the model's "
        f"{model_params:,}; {data.x.shape[0]:,} held-out tokens."
    )
    return lines, {
        "recall": rows,
        "adapter_parameters": adapter.trainable_parameters(),
        "model_parameters": model_params,
    }


def speed_table(args: argparse.Namespace) -> tuple[list[str], list[dict]]:
    settings = {"cache 0.25 (disk)": None, f"cache 0.25 (disk + {args.link})": args.link}
    specs = {
        "plain": SpecConfig(speculative="off"),
        "spec": SpecConfig(speculative="draft", num_speculative_tokens=4, adaptive=True),
    }
    engines = {
        (s, p): load_model(
            EMBEDDED_TARGET,
            EngineConfig(cache_fraction=0.25, offload="disk", link=link, prefetch=p),
        )
        for s, link in settings.items()
        for p in ("none", "adapter")
    }
    prompts = cut_prompts(next(iter(engines.values())).tokenizer, args.data, 1, args.prompt_tokens)
    cells = [(s, d, p) for s in settings for d in specs for p in ("none", "adapter")]

    def measure(cell: tuple[str, str, str]) -> dict:
        setting, decoding, prefetch = cell
        r = run_cell(engines[(setting, prefetch)], specs[decoding], prompts, args.tokens)
        s = r.pop("stats")
        return {
            **r,
            "prefetch_used": s["prefetch_used"],
            "prefetch_issued": s["prefetch_issued"],
            "hit_rate": s["hit_rate"],
        }

    res = interleaved(cells, args.rounds, measure)
    for om in engines.values():
        om.close()
    lines = [
        "| setting | decoding | prefetch | decode tok/s | × no prefetch | stall share | hit rate | prefetches used / issued | expert MB / token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for s, d, p in cells:
        med = summarize(
            res,
            (s, d, p),
            (s, d, "none"),
            (
                "tok_s",
                "stall_share",
                "hit_rate",
                "bytes_per_token",
                "prefetch_used",
                "prefetch_issued",
            ),
        )
        ratio = med["ratio"]
        rows.append({"setting": s, "decoding": d, "prefetch": p, **med})
        lines.append(
            f"| {s} | {d} | {p} | {med['tok_s']:.1f} | {ratio:.2f}× | {med['stall_share']:.0%} | {med['hit_rate']:.0%} | "
            f"{med['prefetch_used']:.0f} / {med['prefetch_issued']:.0f} | {med['bytes_per_token'] / 1e6:.2f} |"
        )
    return lines, rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_flags(ap, prompt_tokens=64, tokens=48, rounds=3, link="sdcard")
    ap.add_argument(
        "--recall-tokens",
        type=int,
        default=20000,
        help="tokens of the held-out split traced for part 1 (default 20000)",
    )
    ap.add_argument(
        "--freq-window",
        type=int,
        default=32,
        help="tokens the frequency baseline counts over (default 32)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    recall_lines, recall = recall_table(args)
    speed_lines, speed = speed_table(args)
    header = (
        f"{machine_line(args.threads, 'no GPU')} Model: "
        f"{portable_path(EMBEDDED_TARGET)} with its {FILE_NAME}. Held-out text: {portable_path(args.data)}. Part 2: one stream, "
        f"{args.prompt_tokens}-token prompt, {args.tokens} greedy tokens, medians of {args.rounds} interleaved rounds after a "
        f"warm-up round; link `{args.link}` emulated."
    )
    lines = [
        "## Next-layer expert recall (held-out split)",
        "",
        *recall_lines,
        "",
        "## Decode speed with and without the prefetcher",
        "",
        *speed_lines,
    ]
    write_report(args.out, header, lines, {**recall, "speed": speed})


if __name__ == "__main__":
    main()
