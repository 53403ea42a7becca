"""Decode speed of the offloading engine against transformers, measured side by side.

Builds one tiny-but-not-trivial qwen3_moe checkpoint (random weights), then in one run and
interleaved over several rounds measures decode tokens/s of:
  - transformers `generate` with the whole model in memory (the reference),
  - our engine at cache 1.0 (everything resident: the ceiling),
  - our engine at cache 0.25 reading experts from disk (uncached I/O),
  - our engine at cache 0.25 from disk behind an emulated slow link,
and the stall time (compute blocked on transfers) as a share of decode wall time.
Results go to stdout and, with --out, to a markdown file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.report import add_common_flags, machine_line, write_report
from engine import EngineConfig, SamplingParams, generate, load_model
from models.tiny import load_reference, make_tiny_checkpoint


def hf_decode(model, ids: list[int], n: int) -> tuple[float, list[int]]:
    """Decode tokens/s of transformers generate, (time for 1+n tokens - time for 1 token) / n, on
    the model's own device (synchronized there), and the n+1 greedy tokens it produced."""
    device = model.device
    inp = torch.tensor([ids], device=device)
    kw = dict(do_sample=False, pad_token_id=0)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        model.generate(inp, max_new_tokens=1, min_new_tokens=1, **kw)
        sync()
        t1 = time.perf_counter()
        out = model.generate(inp, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw)
        sync()
        t2 = time.perf_counter()
    return n / ((t2 - t1) - (t1 - t0)), out[0, len(ids) :].tolist()


def hf_decode_tps(model, ids: list[int], n: int) -> float:
    """Decode tokens/s of transformers generate (see hf_decode)."""
    return hf_decode(model, ids, n)[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tokens", type=int, default=64, help="decode tokens per measurement (default 64)"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; medians are reported (default 3)"
    )
    ap.add_argument(
        "--link",
        default="sdcard",
        help="emulated slow link for the last configuration (default sdcard: 80 MB/s, 1 ms)",
    )
    add_common_flags(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tmp = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    ckpt = make_tiny_checkpoint(
        tmp / "ckpt",
        "qwen3_moe",
        num_layers=4,
        hidden=256,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=128,
        intermediate_size=512,
        head_dim=64,
    )
    ref = load_reference(ckpt)
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    configs = {
        "ours cache=1.0 (ram)": EngineConfig(cache_fraction=1.0, offload="ram"),
        "ours cache=0.25 disk": EngineConfig(cache_fraction=0.25, offload="disk", prefetch="none"),
        f"ours cache=0.25 disk + link {args.link}": EngineConfig(
            cache_fraction=0.25, offload="disk", link=args.link, prefetch="none"
        ),
    }
    models = {name: load_model(ckpt, cfg) for name, cfg in configs.items()}
    params = SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)
    tps: dict[str, list[float]] = {"transformers generate": [], **{n: [] for n in models}}
    stall: dict[str, list[float]] = {n: [] for n in models}
    per_tok: dict[str, dict[str, float]] = {}
    for _ in tqdm(range(args.rounds), desc="bench rounds"):
        tps["transformers generate"].append(hf_decode_tps(ref, ids, args.tokens))
        for name, om in models.items():
            generate(
                om, ids, SamplingParams(max_tokens=2, ignore_eos=True)
            )  # same cache state start
            om.stats.reset()
            res = generate(om, ids, params)
            snap = om.stats.snapshot()
            tps[name].append(res.decode_tokens_per_s)
            stall[name].append(snap["stall_seconds"] / (res.prefill_seconds + res.decode_seconds))
            n = len(res.tokens)
            per_tok[name] = {
                "hit_rate": snap["hit_rate"],
                "MB/token": snap["bytes_moved"] / n / 1e6,
            }
    for om in models.values():
        om.close()

    expert_mb = models["ours cache=1.0 (ram)"].store.slot_bytes / 1e6
    lines = [
        "| configuration | decode tok/s (median) | × transformers (median of per-round ratios) | × all-resident | stall share of wall | hit rate | MB moved / token |",
        "|---|---|---|---|---|---|---|",
    ]
    ref_vals = tps["transformers generate"]
    for name, vals in tps.items():
        m = statistics.median(vals)
        # Ratios within a round share the machine's momentary load, so they are steadier than medians' ratios.
        vs_hf = statistics.median(v / r for v, r in zip(vals, ref_vals))
        vs_ceiling = statistics.median(v / r for v, r in zip(vals, tps["ours cache=1.0 (ram)"]))
        st = f"{statistics.median(stall[name]):.1%}" if name in stall else "–"
        hr = f"{per_tok[name]['hit_rate']:.1%}" if name in per_tok else "–"
        mb = f"{per_tok[name]['MB/token']:.2f}" if name in per_tok else "–"
        lines.append(
            f"| {name} | {m:.1f} | {vs_hf:.2f}× | {vs_ceiling:.2f}× | {st} | {hr} | {mb} |"
        )
    header = (
        f"{machine_line(args.threads)} Checkpoint: random qwen3_moe, 4 layers, hidden 256, 64 experts, top-8, "
        f"moe_intermediate 128, fp32 ({expert_mb:.2f} MB per expert). Prompt 32 tokens, {args.tokens} decode tokens, "
        f"{args.rounds} interleaved rounds."
    )
    write_report(args.out, header, lines, {"tok_s": tps, "stall": stall, "per_token": per_tok})


if __name__ == "__main__":
    main()
