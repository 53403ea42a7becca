"""Seed 000's speed figures: decode tok/s per policy measured side by side in one interleaved run
(bench/policy_bench.py's teacher-forced workload and counters), and the router-trace simulator's
projection of the same policies onto the paper's hardware and model (labelled projected)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.policy_bench import Tally, run_generate, run_teacher_forced
from bench.report import interleaved, summarize
from engine import (
    SHAPES,
    EngineConfig,
    SimSettings,
    Simulator,
    costs_for,
    load_model,
    project_trace,
    trace_from_arrays,
)

# label -> EngineConfig overrides: the presets, the plain rules, and each preset without admission.
SPEED_POLICIES: dict[str, dict[str, Any]] = {
    "fetch-all": {"policy": "fetch-all"},
    "threshold": {"policy": "threshold"},
    "first-choice": {"policy": "first-choice"},
    "quality-first": {"policy": "quality-first"},
    "speed-first": {"policy": "speed-first"},
    "threshold + frequency": {"policy": "threshold", "eviction": "frequency"},
    "first-choice + frequency": {"policy": "first-choice", "eviction": "frequency"},
}
KEYS = (
    "tok_s",
    "stall_share",
    "hit_share",
    "fetched_per_step",
    "substituted_per_step",
    "MB_per_step",
    "admissions",
)


def measured_speed(
    model_dir: Path,
    cache_fraction: float,
    link: str,
    chunks: list[list[int]],
    prompts: list[list[int]],
    tokens: int,
) -> dict[str, list[dict[str, Any]]]:
    """Decode tok/s per policy, experts on disk behind the emulated `link`, for two workloads:
    teacher-forced (one of `chunks` per engine per round) and generate (one of `prompts`, `tokens`
    greedy tokens, prefill excluded). Round-robin after a warm-up round (bench/report.py
    `interleaved`); background loads land when the link delivers them, as in serving."""
    engines = {
        label: load_model(
            model_dir,
            EngineConfig(
                cache_fraction=cache_fraction, offload="disk", link=link, prefetch="none", **over
            ),
        )
        for label, over in SPEED_POLICIES.items()
    }
    turn = {(w, label): 0 for w in ("teacher-forced", "generate") for label in engines}

    def one(cell: tuple[str, str]) -> dict[str, float]:
        workload, label = cell
        tally, i = Tally(), turn[cell]
        if workload == "teacher-forced":
            run_teacher_forced(engines[label], chunks[i % len(chunks)], tally)
        else:
            run_generate(engines[label], prompts[i % len(prompts)], tokens, tally)
        turn[cell] += 1
        return tally.row()

    out: dict[str, list[dict[str, Any]]] = {}
    try:
        for workload, rounds in (("teacher-forced", len(chunks)), ("generate", len(prompts))):
            cells = [(workload, label) for label in engines]
            res = interleaved(cells, rounds, one)
            out[workload] = []
            for cell in cells:
                s = summarize(res, cell, (workload, "fetch-all"), KEYS)
                out[workload].append({"label": cell[1], "vs_fetch_all": s.pop("ratio"), **s})
    finally:
        for om in engines.values():
            om.close()
    return out


def projected_speed(
    arrays: dict, profile: str, shape: str, cache_fraction: float, max_tokens: int
) -> list[dict[str, Any]]:
    """SIMULATED + PROJECTED tok/s per policy: the router trace of the scored tokens, projected onto
    `shape` (engine/offline/projection.py), replayed on `profile`'s costs. As in
    bench/sim_validation.py, stand-ins are dropped (the trace keeps no router logits to rank them)."""
    pt = project_trace(trace_from_arrays(arrays), shape)
    costs = costs_for(profile, SHAPES[shape])
    out, base = [], None
    for label, over in SPEED_POLICIES.items():
        pol = EngineConfig(**over, substitute="drop").policies()
        res = (
            Simulator(
                pt, pol, costs, SimSettings(cache_fraction=cache_fraction, max_tokens=max_tokens)
            )
            .run()
            .to_dict()
        )
        base = base or res["tokens_per_s"]
        out.append(
            {
                "label": label,
                "tok_s": res["tokens_per_s"],
                "vs_fetch_all": res["tokens_per_s"] / base,
                "stall_share": res["stall_share"],
                "loads_per_token": res["loads_per_token"],
                "hit_share": res["hit_share"],
            }
        )
    return out
