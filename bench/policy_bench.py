"""Decode speed per miss policy against fetch-all, measured side by side in one run.

For each slow-tier setting (disk, and disk behind an emulated link) one engine per policy
is loaded, plus the all-resident engine (cache 1.0, RAM) as the ceiling. Two workloads,
both one token per forward step, round-robin across engines so machine noise spreads:
  teacher-forced: windows of held-out text fed token by token (realistic routing);
  generate:       greedy generation from prompts taken from the same text.
Statistics are decode-only (the prefill of `generate` is excluded).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.report import add_common_flags, machine_line, write_report
from engine import (
    CoreLimits,
    EngineConfig,
    EngineCore,
    ModelRunner,
    SamplingParams,
    load_model,
    portable_path,
    score_window,
)

POLICIES = ("fetch-all", "threshold", "first-choice", "quality-first", "speed-first")
COUNTERS = (
    "calls_hit",
    "calls_fetched",
    "substitutions",
    "bytes_moved",
    "stall_seconds",
    "admissions",
)


def _counters(om) -> dict[str, float]:
    s = om.stats.snapshot()
    return {k: s[k] for k in COUNTERS}


class Tally:
    """Decode-only time and counter deltas for one engine and one workload."""

    def __init__(self) -> None:
        self.steps, self.seconds = 0, 0.0
        self.c = {k: 0.0 for k in COUNTERS}

    def add(self, steps: int, seconds: float, before: dict, after: dict) -> None:
        self.steps += steps
        self.seconds += seconds
        for k in COUNTERS:
            self.c[k] += after[k] - before[k]

    def row(self) -> dict[str, float]:
        calls = self.c["calls_hit"] + self.c["calls_fetched"] + self.c["substitutions"]
        return {
            "tok_s": self.steps / self.seconds,
            "stall_share": self.c["stall_seconds"] / self.seconds,
            "hit_share": self.c["calls_hit"] / calls if calls else 1.0,
            "fetched_per_step": self.c["calls_fetched"] / self.steps,
            "substituted_per_step": self.c["substitutions"] / self.steps,
            "MB_per_step": self.c["bytes_moved"] / self.steps / 1e6,
            "admissions": self.c["admissions"],
        }


PROMPT_TOKENS = 64


def workload(
    tokenizer, data: str | Path, windows: int, window: int, prompts: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The teacher-forced windows and the generation prompts (PROMPT_TOKENS long), cut from evenly
    spaced places in the text (bench/sim_validation.py replays the same prompts)."""
    ids = tokenizer(Path(data).read_text(encoding="utf-8"))["input_ids"]
    stride = len(ids) // (windows + prompts)
    spaced = [ids[i * stride : i * stride + window] for i in range(windows + prompts)]
    return spaced[:windows], [c[:PROMPT_TOKENS] for c in spaced[windows:]]


def run_teacher_forced(om, chunk: list[int], tally: Tally) -> None:
    before, t0 = _counters(om), time.perf_counter()
    score_window(ModelRunner(om), chunk)
    tally.add(len(chunk) - 1, time.perf_counter() - t0, before, _counters(om))


def run_generate(om, prompt: list[int], tokens: int, tally: Tally) -> None:
    core = EngineCore.for_model(om, CoreLimits(max_running=1, max_model_len=1 << 20))
    core.add(core.local_request(prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True)))
    core.step()  # the prefill gives the first token: start the decode clock here
    before, t0 = _counters(om), time.perf_counter()
    while core.has_work():
        core.step()
    tally.add(tokens, time.perf_counter() - t0, before, _counters(om))


def table(rows: list[dict], workload: str) -> list[str]:
    out = [
        f"**{workload}**",
        "",
        "| slow tier | policy | decode tok/s | × fetch-all (same tier) | × all-resident | stall share | hit share of calls | fetched calls/step | substituted calls/step | MB moved/step | admissions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['setting']} | {r['policy']} | {r['tok_s']:.1f} | {r['vs_fetch_all']:.2f}× | {r['vs_ceiling']:.2f}× | {r['stall_share']:.0%} | "
            f"{r['hit_share']:.0%} | {r['fetched_per_step']:.2f} | {r['substituted_per_step']:.2f} | {r['MB_per_step']:.3f} | {int(r['admissions'])} |"
        )
    return out + [""]


def main() -> None:
    from cli.common import resolve_model_dir

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument(
        "--data",
        default="models/embedded/data/test.txt",
        help="held-out text (default: the embedded test split)",
    )
    ap.add_argument(
        "--cache-fraction",
        type=float,
        default=0.25,
        help="fast-tier share of experts (default 0.25)",
    )
    ap.add_argument(
        "--link",
        default="sdcard",
        help="emulated slow link for the second setting (default sdcard: 80 MB/s, 1 ms)",
    )
    ap.add_argument("--windows", type=int, default=4, help="teacher-forced windows (default 4)")
    ap.add_argument(
        "--window", type=int, default=128, help="tokens per teacher-forced window (default 128)"
    )
    ap.add_argument("--prompts", type=int, default=3, help="generation prompts (default 3)")
    ap.add_argument(
        "--tokens", type=int, default=48, help="greedy decode tokens per prompt (default 48)"
    )
    ap.add_argument(
        "--prefetch",
        default="auto",
        metavar="A,B,...",
        help="engine --prefetch settings to compare, each a row group (default auto: SpecPrefetch's adapter where the model ships one; e.g. auto,none)",
    )
    add_common_flags(ap, "write markdown tables here (the numbers as JSON beside it)")
    ap.add_argument("--out-json", type=Path, help="write raw numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir(args.model)
    prefetch = [p.strip() for p in args.prefetch.split(",") if p.strip()]
    settings = {}
    for pf in prefetch:
        label = "" if len(prefetch) == 1 else f", prefetch {pf}"
        settings[f"disk{label}"] = dict(offload="disk", prefetch=pf)
        settings[f"disk + {args.link}{label}"] = dict(offload="disk", link=args.link, prefetch=pf)
    engines = {
        ("all-resident (ram)", "fetch-all"): load_model(model_dir, EngineConfig(cache_fraction=1.0))
    }
    for sname, kw in settings.items():
        for p in POLICIES:
            engines[(sname, p)] = load_model(
                model_dir, EngineConfig(cache_fraction=args.cache_fraction, policy=p, **kw)
            )
    chunks, prompts = workload(
        next(iter(engines.values())).tokenizer, args.data, args.windows, args.window, args.prompts
    )
    tallies = {w: {k: Tally() for k in engines} for w in ("teacher-forced", "generate")}
    for chunk in tqdm(chunks, desc="teacher-forced windows"):
        for key, om in engines.items():
            run_teacher_forced(om, chunk, tallies["teacher-forced"][key])
    for prompt in tqdm(prompts, desc="generation prompts"):
        for key, om in engines.items():
            run_generate(om, prompt, args.tokens, tallies["generate"][key])
    for om in engines.values():
        om.close()

    header = (
        f"{machine_line(args.threads)} Model: {portable_path(model_dir)}. "
        f"Cache fraction {args.cache_fraction}. Teacher-forced: {len(chunks)} windows x {args.window} tokens of {args.data}; "
        f"generate: {len(prompts)} prompts of {PROMPT_TOKENS} tokens, {args.tokens} greedy tokens. The link `{args.link}` is emulated. "
        f"Prefetch: {', '.join(prefetch)}."
    )
    md, raw = [header, ""], {}
    for mode, t in tallies.items():
        rows = [{"setting": s, "policy": p, **t[(s, p)].row()} for (s, p) in engines]
        ceiling = rows[0]["tok_s"]
        for r in rows:
            base = next(
                x for x in rows if x["setting"] == r["setting"] and x["policy"] == "fetch-all"
            )
            r["vs_fetch_all"], r["vs_ceiling"] = r["tok_s"] / base["tok_s"], r["tok_s"] / ceiling
        md += table(rows, mode)
        raw[mode] = rows
    write_report(args.out, header, md[2:], raw)  # keeps the page's analysis (from "Command:" on)
    if args.out_json:
        args.out_json.write_text(json.dumps({"header": header, **raw}, indent=2))


if __name__ == "__main__":
    main()
