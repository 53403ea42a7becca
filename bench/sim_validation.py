"""The simulator against the engine: predicted speed-up next to the engine's measured speed-up on
this machine, for every policy / configuration in the measured tables, and projected tok/s for
every hardware profile and projected shape.

Measured tables (read from their JSON, nothing re-run): docs/benchmarks/policies_speed.json
(miss policies vs fetch-all), spac.json (speculation, utility prefetch/eviction, CPU-run experts
vs plain), speculative.json (draft k and adaptive k vs off), concurrency.json (streams vs one).
Each comparison is a ratio to the same table's baseline in the same setting, simulated on the
profile of that setting (this-machine-disk, this-machine-disk-hdd; cache 1.0 needs no link).

Inputs taken from the measured rows themselves, and why: a speculative row's acceptance by
position (the draft's quality is an input to the simulator, not something it predicts). Workload
shape as the benchmarks ran it: requests of 32 tokens (24 for concurrency) started together, a
fresh adaptive-k state per batch of requests (bench/spec_bench.py builds a proposer per cell).

    python -m bench.sim_validation --out docs/benchmarks/simulator.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.policy_bench import PROMPT_TOKENS
from bench.report import add_common_flags, write_report
from bench.spac_bench import CONFIGS as SPAC_CONFIGS
from engine import (
    SHAPES,
    Acceptance,
    EngineConfig,
    SimSettings,
    Simulator,
    SpecConfig,
    costs_for,
    list_profiles,
    load_trace,
    project_trace,
    trace_from_arrays,
)

DOCS = Path("docs/benchmarks")
HEADER = (
    "# The router-trace simulator against the engine, and projections (all figures below are SIMULATED; "
    "projected ones are also PROJECTED)"
)
PROFILE_OF = {
    "disk": "this-machine-disk",
    "disk + hdd": "this-machine-disk-hdd",
    "cache 0.25 (disk)": "this-machine-disk",
    "cache 0.25 (disk + hdd)": "this-machine-disk-hdd",
    "cache 1.0 (ram)": "this-machine-disk",
    "all-resident (ram)": "this-machine-disk",
}
POLICIES = ("fetch-all", "threshold", "first-choice", "quality-first", "speed-first")


def _spac_as_sim(
    spec: SpecConfig, engine_kw: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One bench/spac_bench.py configuration as (simulator settings, policy settings)."""
    sim: dict[str, Any] = {k: engine_kw[k] for k in ("prefetch", "cpu_experts") if k in engine_kw}
    if spec.speculative != "off":
        sim["speculative"] = True
    return sim, {k: engine_kw[k] for k in ("eviction", "policy") if k in engine_kw}


SPAC = {
    name: _spac_as_sim(*cfg) for name, cfg in SPAC_CONFIGS.items()
}  # the benchmark's own table: no drift
SPEC = {
    "off": {},
    "draft k=2": {"speculative": True, "k": 2, "adaptive": False},
    "draft k=4": {"speculative": True, "k": 4, "adaptive": False},
    "draft k=6": {"speculative": True, "k": 6, "adaptive": False},
    "draft adaptive (k<=4)": {"speculative": True, "k": 4, "adaptive": True},
}


def generate_trace(data: str, windows: int, window: int, prompts: int, tokens: int) -> dict:
    """The routing of bench/policy_bench.py's `generate` workload: its prompts, each followed by
    the greedy tokens the exact engine generates from it (= transformers'), traced as one window
    per request. Generated text routes differently from the test text (on v2 fetch-all hit 93 %
    of calls generating against 78 % teacher-forced), so those rows are replayed on this."""
    from bench.engine_bench import hf_decode
    from bench.policy_bench import workload
    from cli.common import resolve_model_dir
    from engine import active, load_model, record_trace

    om = load_model(resolve_model_dir(None), EngineConfig(cache_fraction=1.0))
    try:
        _, cut = workload(om.tokenizer, data, windows, window, prompts)
        # The decode steps the benchmark times read the prompt's first generated token onwards.
        with active(om.native):  # transformers' generate on the model: its own native kernels
            seqs = [
                p + hf_decode(om.model, p, tokens)[1][:tokens] for p in tqdm(cut, desc="generating")
            ]
        return trace_from_arrays(
            record_trace(om, [t for q in seqs for t in q], len(seqs[0]), logits=True)
        )
    finally:
        om.close()


class Runner:
    def __init__(self, trace: dict, max_tokens: int | None) -> None:
        self.trace, self.max_tokens = trace, max_tokens
        self.replay: list[tuple[int, float]] = []  # (token-layers, seconds) of every run

    def tok_s(self, setting: str, policy: dict[str, Any] | None = None, **settings: Any) -> dict:
        cache = 1.0 if "ram" in setting else 0.25
        costs = costs_for(PROFILE_OF[setting], "embedded", self.trace["meta"]["expert_nbytes"])
        tokens = self.max_tokens * settings.get("streams", 1) if self.max_tokens else None
        s = SimSettings(cache_fraction=cache, max_tokens=tokens, **settings)
        res = Simulator(self.trace, EngineConfig(**(policy or {})).policies(), costs, s).run()
        self.replay.append((res.token_layers, res.replay_s))
        return res.to_dict()


def _err(sim: float, meas: float) -> float:
    return sim / meas - 1.0


def validate(run: Runner, gen: Runner, gen_tokens: int) -> list[dict]:
    """`gen`: replays the generate workload's trace (requests of a prompt and gen_tokens)."""
    rows: list[dict] = []

    def add(
        table: str,
        setting: str,
        streams: int,
        config: str,
        base: str,
        meas: float,
        sim_r: dict,
        sim_base: dict,
    ) -> None:
        sim = sim_r["tokens_per_s"] / sim_base["tokens_per_s"]
        rows.append(
            {
                "table": table,
                "setting": setting,
                "streams": streams,
                "config": config,
                "baseline": base,
                "measured_x": meas,
                "simulated_x": sim,
                "error": _err(sim, meas),
                "simulated_tok_s": sim_r["tokens_per_s"],
                "simulated_stall": sim_r["stall_share"],
                "simulated_loads_per_token": sim_r["loads_per_token"],
            }
        )

    pol = json.loads((DOCS / "policies_speed.json").read_text())
    for setting in ("disk", "disk + hdd"):
        by_mode = {
            "teacher-forced": {p: run.tok_s(setting, {"policy": p}) for p in POLICIES},
            "generate": {
                p: gen.tok_s(
                    setting, {"policy": p}, request_tokens=gen_tokens, prompt_tokens=PROMPT_TOKENS
                )
                for p in POLICIES
            },
        }
        for mode, sims in by_mode.items():
            for r in pol[mode]:
                if r["setting"] == setting and r["policy"] != "fetch-all":
                    add(
                        f"policies_speed ({mode})",
                        setting,
                        1,
                        r["policy"],
                        "fetch-all",
                        r["vs_fetch_all"],
                        sims[r["policy"]],
                        sims["fetch-all"],
                    )

    spac = json.loads((DOCS / "spac.json").read_text())["rows"]
    spec_rows = json.loads((DOCS / "speculative.json").read_text())["rows"]
    acc_of = {
        (r["setting"], r["streams"]): r["acceptance_by_position"]
        for r in spec_rows
        if r["config"] == "draft adaptive (k<=4)"
    }
    for setting in ("cache 0.25 (disk)", "cache 0.25 (disk + hdd)"):
        for n in (1, 8):
            acc = Acceptance(tuple(acc_of[(setting, n)]))
            sims = {
                c: run.tok_s(
                    setting, pol_over, streams=n, acceptance=acc, request_tokens=32, **set_over
                )
                for c, (set_over, pol_over) in SPAC.items()
            }
            for r in spac:
                if r["setting"] == setting and r["streams"] == n and r["config"] != "plain":
                    add(
                        "spac",
                        setting,
                        n,
                        r["config"],
                        "plain",
                        r["ratio"],
                        sims[r["config"]],
                        sims["plain"],
                    )

    for setting in ("cache 1.0 (ram)", "cache 0.25 (disk)", "cache 0.25 (disk + hdd)"):
        for n in (1, 8):
            sims = {}
            for c, over in SPEC.items():
                acc = next(
                    (
                        r["acceptance_by_position"]
                        for r in spec_rows
                        if (r["setting"], r["streams"], r["config"]) == (setting, n, c)
                    ),
                    [],
                )
                sims[c] = run.tok_s(
                    setting,
                    streams=n,
                    acceptance=Acceptance(tuple(acc) or (0.0,)),
                    request_tokens=32,
                    **over,
                )
            for r in spec_rows:
                if (
                    r["setting"] == setting
                    and r["streams"] == n
                    and r["config"] in SPEC
                    and r["config"] != "off"
                ):
                    add(
                        "speculative",
                        setting,
                        n,
                        r["config"],
                        "off",
                        r["ratio"],
                        sims[r["config"]],
                        sims["off"],
                    )

    conc = json.loads((DOCS / "concurrency.json").read_text())["rows"]
    for setting in ("cache 1.0 (ram)", "cache 0.25 (disk)", "cache 0.25 (disk + hdd)"):
        sims = {n: run.tok_s(setting, streams=n, request_tokens=24) for n in (1, 4, 8, 16)}
        for r in conc:
            if r["setting"] == setting and r["streams"] != 1:
                add(
                    "concurrency",
                    setting,
                    r["streams"],
                    f"{r['streams']} streams",
                    "1 stream",
                    r["tok_s_vs_1"],
                    sims[r["streams"]],
                    sims[1],
                )
    return rows


def projections(trace: dict, max_tokens: int) -> list[dict]:
    """Projected tok/s per policy and configuration, for every profile and projected shape."""
    out = []
    configs = {
        "fetch-all": ({}, {"policy": "fetch-all"}),
        "threshold": ({}, {"policy": "threshold", "substitute": "drop"}),
        "first-choice": ({}, {"policy": "first-choice", "substitute": "drop"}),
        "quality-first": ({}, {"policy": "quality-first", "substitute": "drop"}),
        "speed-first": ({}, {"policy": "speed-first", "substitute": "drop"}),
        "spec+utility+cpu (exact)": (
            {"speculative": True, "prefetch": "utility", "cpu_experts": "auto"},
            {"eviction": "utility"},
        ),
        "oracle next-layer prefetch (bound)": ({"predictor": "oracle"}, {}),
    }
    from engine import OraclePredictor

    cells = [(p, sh) for sh in ("qwen3-30b-a3b", "qwen3-next-80b-a3b") for p in list_profiles()]
    for prof, shape in tqdm(cells, desc="projections"):
        pt = project_trace(trace, shape)
        costs = costs_for(prof, SHAPES[shape])
        base = None
        for name, (set_over, pol_over) in configs.items():
            set_over = dict(set_over)
            if set_over.get("predictor") == "oracle":
                set_over["predictor"] = OraclePredictor(pt)
            res = (
                Simulator(
                    pt,
                    EngineConfig(**pol_over).policies(),
                    costs,
                    SimSettings(max_tokens=max_tokens, **set_over),
                )
                .run()
                .to_dict()
            )
            base = base or res["tokens_per_s"]
            out.append(
                {
                    "profile": prof,
                    "shape": shape,
                    "config": name,
                    "tokens_per_s": res["tokens_per_s"],
                    "x_fetch_all": res["tokens_per_s"] / base,
                    "stall_share": res["stall_share"],
                    "loads_per_token": res["loads_per_token"],
                    "hit_share": res["hit_share"],
                    "cpu_per_token": res["cpu_expert_calls"] / max(res["tokens"], 1),
                    "token_layers_per_s": res["token_layers_per_s"],
                }
            )
    return out


def replay_speed(trace: dict) -> list[dict]:
    """Token-layers per second of replay (best of 3 runs each; the machine is shared)."""
    out = []
    costs = costs_for("this-machine-disk-hdd", "embedded", trace["meta"]["expert_nbytes"])
    cases = [
        ("fetch-all, 1 stream", {"policy": "fetch-all"}, {}),
        ("speed-first, 1 stream", {"policy": "speed-first"}, {}),
        ("fetch-all, 8 streams", {"policy": "fetch-all"}, {"streams": 8}),
        (
            "spec+utility+cpu, 1 stream",
            {"eviction": "utility"},
            {"speculative": True, "prefetch": "utility", "cpu_experts": "auto"},
        ),
    ]
    for name, pol, st in cases:
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            res = Simulator(trace, EngineConfig(**pol).policies(), costs, SimSettings(**st)).run()
            best = max(best, res.token_layers / (time.perf_counter() - t0))
        out.append({"case": name, "token_layers": res.token_layers, "token_layers_per_s": best})
    return out


def render(d: dict) -> list[str]:
    """The markdown tables of a validation run (d as written to the JSON)."""
    rows, lines = d["validation"], []
    lines += [
        "### Validation: SIMULATED speed-up next to the engine's MEASURED speed-up (this machine, embedded model)",
        "",
        "| measured table | setting | streams | configuration | against | measured | SIMULATED | error | within 15 % | simulated tok/s | simulated stall | simulated loads / token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['table']} | {r['setting']} | {r['streams']} | {r['config']} | {r['baseline']} | {r['measured_x']:.2f}× | {r['simulated_x']:.2f}× | "
            f"{r['error']:+.0%} | {'yes' if abs(r['error']) <= 0.15 else '**no**'} | {r['simulated_tok_s']:.1f} | {r['simulated_stall']:.0%} | {r['simulated_loads_per_token']:.2f} |"
        )
    errs = sorted(abs(r["error"]) for r in rows)
    lines += [
        "",
        f"Within 15 %: **{d['within_15pct']} of {d['cells']}** cells; median |error| {statistics.median(errs):.1%}; "
        f"90th percentile {errs[int(0.9 * (len(errs) - 1))]:.1%}.",
        "",
    ]
    per_table: dict[str, list[float]] = {}
    for r in rows:
        per_table.setdefault(r["table"], []).append(abs(r["error"]))
    lines += ["| measured table | cells | within 15 % | median abs. error |", "|---|---|---|---|"]
    for t, es in per_table.items():
        lines.append(
            f"| {t} | {len(es)} | {sum(e <= 0.15 for e in es)} | {statistics.median(es):.1%} |"
        )
    lines += [
        "",
        "### Replay speed (this machine, shared, 1 thread; best of 3)",
        "",
        "| case | token-layers replayed | token-layers / s |",
        "|---|---|---|",
    ]
    for sp in d["replay_speed"]:
        lines.append(f"| {sp['case']} | {sp['token_layers']} | {sp['token_layers_per_s']:,.0f} |")
    proj = d.get("projections") or []
    if proj:
        lines += [
            "",
            "### PROJECTED + SIMULATED decode tok/s (cache 0.25, one stream; engine/offline/projection.py states the assumptions)",
            "",
        ]
        for shape in dict.fromkeys(p["shape"] for p in proj):
            configs = list(dict.fromkeys(p["config"] for p in proj if p["shape"] == shape))
            lines += [
                f"**{shape}** (projected from the embedded model's trace)",
                "",
                "| profile | " + " | ".join(configs) + " |",
                "|---|" + "---|" * len(configs),
            ]
            for prof in dict.fromkeys(p["profile"] for p in proj if p["shape"] == shape):
                cells = []
                for c in configs:
                    p = next(
                        p
                        for p in proj
                        if (p["profile"], p["shape"], p["config"]) == (prof, shape, c)
                    )
                    cells.append(
                        f"{p['tokens_per_s']:.1f} ({p['x_fetch_all']:.2f}×, stall {p['stall_share']:.0%})"
                    )
                lines.append(f"| {prof} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--trace",
        default="docs/benchmarks/embedded_test_trace.npz",
        help="trace with logits (moe-offload trace --logits)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="tokens per stream replayed per validation cell (default 1024)",
    )
    ap.add_argument(
        "--projection-tokens",
        type=int,
        default=256,
        help="tokens replayed per projected cell (default 256: 48-layer replays are slower)",
    )
    ap.add_argument(
        "--data",
        default="models/embedded/data/test.txt",
        help="text bench/policy_bench.py cut its generation prompts from (default: the test split)",
    )
    ap.add_argument(
        "--bench-windows",
        type=int,
        default=4,
        help="policy_bench's --windows, which places its prompts (default 4, as policies_speed.md ran)",
    )
    ap.add_argument(
        "--bench-window", type=int, default=128, help="policy_bench's --window (default 128)"
    )
    ap.add_argument(
        "--bench-prompts", type=int, default=3, help="policy_bench's --prompts (default 3)"
    )
    ap.add_argument(
        "--bench-tokens",
        type=int,
        default=48,
        help="policy_bench's --tokens: greedy tokens per prompt (default 48)",
    )
    ap.add_argument(
        "--skip-projections",
        action="store_true",
        help="only the validation against measured tables",
    )
    add_common_flags(
        ap,
        "write the tables here (.md; the numbers as JSON beside it; analysis from a line starting 'Command:' on is kept)",
        threads=False,
    )
    ap.add_argument(
        "--from-json",
        type=Path,
        help="render the tables of an earlier run's JSON instead of running",
    )
    args = ap.parse_args()
    if args.from_json:
        d = json.loads(args.from_json.read_text())
        write_report(
            args.out,
            d.get("header", HEADER),
            render(d),
            {k: v for k, v in d.items() if k != "header"},
        )
        return
    trace = load_trace(args.trace)
    run = Runner(trace, args.max_tokens)
    gen = Runner(
        generate_trace(
            args.data, args.bench_windows, args.bench_window, args.bench_prompts, args.bench_tokens
        ),
        None,
    )
    rows = validate(run, gen, args.bench_tokens)
    print(
        f"{'table':28s} {'setting':24s} {'n':>2s} {'config':30s} {'measured':>8s} {'simulated':>9s} {'error':>7s}"
    )
    for r in rows:
        print(
            f"{r['table']:28s} {r['setting']:24s} {r['streams']:2d} {r['config']:30s} {r['measured_x']:7.2f}x {r['simulated_x']:8.2f}x {r['error']:+7.0%}"
        )
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    print(
        f"within 15 %: {within} of {len(rows)}; median |error| {statistics.median(abs(r['error']) for r in rows):.1%}"
    )
    speed = replay_speed(trace)
    for s in speed:
        print(f"replay {s['case']}: {s['token_layers_per_s']:.0f} token-layers/s")
    proj = [] if args.skip_projections else projections(trace, args.projection_tokens)
    for p in proj:
        print(
            f"PROJECTED {p['profile']:22s} {p['shape']:20s} {p['config']:36s} {p['tokens_per_s']:9.1f} tok/s {p['x_fetch_all']:6.2f}x"
        )
    d = {
        "simulated": True,
        "validation": rows,
        "replay_speed": speed,
        "projections": proj,
        "within_15pct": within,
        "cells": len(rows),
    }
    d = json.loads(json.dumps(d, default=str).replace("NaN", "null"))
    if args.out:
        write_report(args.out, HEADER, render(d), d)


if __name__ == "__main__":
    main()
