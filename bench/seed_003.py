"""Seed 003 (SpecPrefetch), its tables run on this project's embedded pair:
`python -m bench seed-003` regenerates docs/seeds/003-specprefetch.md, its JSON and plot.

1. Recall: every predictor the paper compares (SpecPrefetch in the shipped and in the paper's plain
   form, FATE, a ProMoE-style per-layer MLP, the draft model) fitted on the validation text and
   scored on held-out tokens, with parameter counts (bench/seed003_recall.py).
2. Decode speed, warm and cold cache: measured with the engine for every predictor (the draft
   model runs on each token of the target's step, charged to the decode), on the local disk and
   behind an emulated slow link, side by side in one interleaved run; and simulated for all of
   them (bench/seed003_speed.py).

`--only-draft` runs the draft-model predictor's measured rows alone (no prefetch and FATE beside
it, in one interleaved run; its heads refitted) and merges them into the JSON as `draft_run`,
whose rows the page shows apart, with that run's machine and load. `--only-real-shape` measures no
prefetch, the FATE-like guess and an adapter fitted for it on a RANDOM-WEIGHT checkpoint of
Qwen3-30B-A3B's layer shape (bench/seed_real_shape.py) and merges them into the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import add_common_flags, cut_prompts, machine_line, positive_int
from bench.seed003_page import render, write_plot
from bench.seed003_recall import DRAFT, FATE, RecallSetup, recall_run
from bench.seed003_speed import (
    SpeedSetup,
    bandwidth_sweep,
    measured,
    sim_profiles,
    simulated,
)
from bench.seed_real_shape import add_real_shape_flags, carry_real_shape, merge_real_shape
from engine import portable_path

DATA = Path("models/embedded/data")
SWEEP_MB_S = (25.0, 80.0, 250.0, 800.0, 2500.0, 8000.0)  # SD card .. NVMe


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="target model directory (default: the embedded target)")
    ap.add_argument("--draft", help="draft model directory (default: the embedded draft)")
    ap.add_argument(
        "--train-data",
        default=str(DATA / "valid.txt"),
        help="text the predictors are fitted on (default: the validation split, as the shipped adapter)",
    )
    ap.add_argument(
        "--data",
        default=str(DATA / "test.txt"),
        help="held-out text: recall, the simulator's trace and the prompts (default: the test split)",
    )
    ap.add_argument(
        "--train-tokens",
        type=positive_int,
        default=30000,
        help="tokens traced for fitting (default 30000; the shipped adapter saw 60000)",
    )
    ap.add_argument(
        "--test-tokens",
        type=positive_int,
        default=8192,
        help="held-out tokens scored and replayed (default 8192)",
    )
    ap.add_argument(
        "--steps",
        type=positive_int,
        default=1500,
        help="optimiser steps of 1024 examples per trained predictor (default 1500, the shipped recipe)",
    )
    ap.add_argument(
        "--rank", type=positive_int, default=64, help="rank of the plain adapter (default 64)"
    )
    ap.add_argument(
        "--promoe-width",
        type=positive_int,
        default=512,
        help="hidden width of the ProMoE-style per-layer MLP (default 512)",
    )
    ap.add_argument(
        "--cache-fraction",
        type=float,
        default=0.25,
        help="fast-tier share of experts for the speed runs (default 0.25)",
    )
    ap.add_argument(
        "--link",
        default="sdcard",
        help="emulated slow link of the speed runs, beside the plain disk (default sdcard: the paper's slowest storage)",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=32,
        help="prompt tokens per speed-run request (default 32)",
    )
    ap.add_argument(
        "--tokens",
        type=positive_int,
        default=48,
        help="greedy tokens per speed-run request (default 48)",
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=8,
        help="measured rounds of the speed run after its warm-up round (default 8)",
    )
    ap.add_argument(
        "--sim-requests",
        type=positive_int,
        default=32,
        help="cold-cache requests the simulator replays per cell (default 32)",
    )
    ap.add_argument(
        "--sweep-tokens",
        type=positive_int,
        default=2048,
        help="held-out tokens the simulator's bandwidth sweep replays per point (default 2048)",
    )
    ap.add_argument(
        "--no-speed",
        action="store_true",
        help="skip the measured speed run (recall and simulator only)",
    )
    ap.add_argument(
        "--only-draft",
        action="store_true",
        help="measure only the draft-model predictor in the engine (beside no prefetch and FATE) and merge "
        "its rows into the JSON beside --out, then rewrite the page",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite the page and plot from the JSON beside --out",
    )
    add_real_shape_flags(ap)
    add_common_flags(
        ap, "write the page here (default docs/seeds/003-specprefetch.md; JSON and plot beside it)"
    )
    return ap.parse_args()


def recall_setup(
    args: argparse.Namespace, model_dir: Path, draft_dir: Path, only: tuple[str, ...] = ()
) -> RecallSetup:
    return RecallSetup(
        model_dir, draft_dir, args.train_data, args.data, args.train_tokens, args.test_tokens,
        args.steps, args.rank, args.promoe_width, only=only,
    )  # fmt: skip


def engine_predictors(modules: dict[str, torch.nn.Module], draft_dir: Path) -> dict[str, Any]:
    """The predictors as the engine runs them: the draft's heads on the draft model, loaded for each
    engine as its speculative proposer would be (engine/speculative/draft_prefetch.py)."""
    from engine import draft_predictor

    def with_draft(heads: torch.nn.Module) -> Any:
        return lambda om: draft_predictor(om, draft_dir, heads)

    return {n: with_draft(m) if n == DRAFT else m for n, m in modules.items()}


def speed_run(
    args: argparse.Namespace, model_dir: Path, modules: dict[str, Any]
) -> tuple[list[dict], dict[str, float]]:
    """The measured rows (bench/seed003_speed.py `measured`) and the machine's load around them."""
    from transformers import AutoTokenizer

    prompts = cut_prompts(
        AutoTokenizer.from_pretrained(model_dir), args.data, args.rounds + 1, args.prompt_tokens
    )
    load_before = os.getloadavg()[0]  # the machine is shared: the page says how busy it was
    speed = measured(
        SpeedSetup(
            model_dir, args.cache_fraction, ("", args.link), prompts, args.tokens, args.rounds
        ),  # fmt: skip
        modules,
    )
    return speed, {"before": load_before, "after": os.getloadavg()[0]}


def draft_only(args: argparse.Namespace, out: Path, model_dir: Path, draft_dir: Path) -> int:
    """--only-draft: the draft-model predictor measured in the engine beside no prefetch and FATE,
    merged into the JSON of a full run as `draft_run`; the page is rewritten from it."""
    t0 = time.perf_counter()
    result = json.loads(out.with_suffix(".json").read_text())
    rec = recall_run(recall_setup(args, model_dir, draft_dir, only=(FATE, DRAFT)))
    speed, load = speed_run(args, model_dir, engine_predictors(rec["modules"], draft_dir))
    result["draft_run"] = {
        "machine": machine_line(args.threads),
        "args": {k: str(v) for k, v in vars(args).items()},
        "seconds": time.perf_counter() - t0,
        "rows": rec["rows"],
        "speed": speed,
        "load_average": load,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_plot(result, out)
    out.write_text(render(result, out))
    print(
        f"merged the draft run into {out.with_suffix('.json')} in {time.perf_counter() - t0:.0f} s"
    )
    return 0


def main() -> int:
    from cli.common import resolve_model_dir
    from models import EMBEDDED_DRAFT

    args = parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path("docs/seeds/003-specprefetch.md")
    if args.only_real_shape:  # measured alone, merged into the JSON; the page is rewritten below
        merge_real_shape("003", args, out)
    if args.render_only or args.only_real_shape:
        result = json.loads(out.with_suffix(".json").read_text())
        write_plot(result, out)
        out.write_text(render(result, out))
        return 0
    model_dir = Path(resolve_model_dir(args.model))
    draft_dir = Path(args.draft) if args.draft else EMBEDDED_DRAFT
    if args.only_draft:
        return draft_only(args, out, model_dir, draft_dir)
    t0 = time.perf_counter()
    rec = recall_run(recall_setup(args, model_dir, draft_dir))
    ranked, modules, trace = rec.pop("ranked"), rec.pop("modules"), rec.pop("held_trace")
    profiles = sim_profiles("embedded", args.link)
    sim = simulated(
        trace,
        ranked,
        profiles,
        args.cache_fraction,
        args.prompt_tokens,
        args.tokens,
        args.sim_requests,
    )
    sweep = {
        name: bandwidth_sweep(
            trace, ranked, profiles[name], args.cache_fraction, SWEEP_MB_S, args.sweep_tokens
        )
        for name in (
            "this machine, disk",
            "this machine, disk, loads off the compute thread",
            "phone (UFS 3.1)",
        )
    }
    speed: list[dict] = []
    load: dict[str, float] = {}
    if not args.no_speed:
        speed, load = speed_run(args, model_dir, engine_predictors(modules, draft_dir))
    result = {
        "machine": machine_line(args.threads),
        "model": portable_path(model_dir),
        "draft": portable_path(draft_dir),
        "args": {k: str(v) for k, v in vars(args).items()},
        "seconds": time.perf_counter() - t0,
        **rec,
        "simulated": sim,
        "sweep": sweep,
        "speed": speed,
        "load_average": load,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    carry_real_shape(out, result)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    write_plot(result, out)
    out.write_text(render(result, out))
    print(f"wrote {out} and {out.with_suffix('.json')} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
