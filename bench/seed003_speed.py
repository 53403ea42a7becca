"""Seed 003's decode-speed figures, warm and cold cache, for every predictor:

- measured: the engine decoding greedily with each predictor driving its prefetches
  (engine/prefetch/adapter_prefetcher.py `use_predictor`), experts on disk and behind an
  emulated link, side by side in one interleaved run after a warm-up round. Warm: one engine per
  cell, kept across rounds (its fast tier holds the previous requests' experts). Cold: a fresh
  engine per run that starts with an empty fast tier (`warm_start=False`). The draft-model
  predictor runs the draft on every token of the target's step, on the decode's thread
  (engine/prefetch/draft_predictor.py): its cells record the draft's own time per forward.
- simulated: the router-trace simulator (engine/offline/simulator.py) replaying the held-out
  trace with each predictor's own held-out predictions (TablePredictor), on this machine's
  measured disk profile, the same with the emulated link, and a phone profile (the paper's
  device class). Warm: one replay of the whole trace; cold: every request from an empty tier.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.report import interleaved, summarize
from engine import (
    NAMED_LINKS,
    Costs,
    EngineConfig,
    SimSettings,
    Simulator,
    TablePredictor,
    costs_for,
    trace_from_arrays,
)

NONE = "no prefetch"
COLD_1 = "cold, 1-token prompt"
# warm: the engine kept across requests; cold: an empty fast tier before the prompt's prefill;
# cold with a 1-token prompt: an empty fast tier when decode starts.
CACHES = ("warm", "cold", COLD_1)
KEYS = ("tok_s", "stall_share", "hit_rate", "prefetch_used", "prefetch_issued")


@dataclass
class SpeedSetup:
    model_dir: Path
    cache_fraction: float
    links: tuple[str, ...]  # "" = the local disk, else an emulated link's name
    prompts: list[list[int]]  # one per round (warm-up included), the same for every cell
    tokens: int
    rounds: int


# A predictor: a module, or what builds one for a loaded engine (the draft model's, which runs the
# draft as the engine does: engine/speculative/draft_prefetch.py).
Predictor = torch.nn.Module | Callable[[Any], torch.nn.Module]


def _engine(s: SpeedSetup, link: str, module: Predictor | None, warm: bool) -> Any:
    from engine import load_model

    om = load_model(
        s.model_dir,
        EngineConfig(
            cache_fraction=s.cache_fraction,
            offload="disk",
            link=link or None,
            prefetch="adapter" if module is not None else "none",
            warm_start=warm,
        ),
    )
    if isinstance(module, torch.nn.Module):
        om.adapter_prefetcher.use_predictor(module.to(om.device))
    elif module is not None:
        om.adapter_prefetcher.use_predictor(module(om))
    return om


def measured(s: SpeedSetup, modules: Mapping[str, Predictor]) -> list[dict[str, Any]]:
    """Decode tok/s per (link, cache, predictor), ratios to no prefetch within each round."""
    from bench.spec_bench import run_cell
    from engine import SpecConfig

    named: dict[str, Predictor | None] = {NONE: None, **modules}
    warm = {(link, n): _engine(s, link, m, True) for link in s.links for n, m in named.items()}
    cells = [(link, cache, n) for link in s.links for cache in CACHES for n in named]
    turn = dict.fromkeys(cells, 0)
    plain = SpecConfig(speculative="off")

    def one(cell: tuple[str, str, str]) -> dict[str, float]:
        link, cache, name = cell
        prompt = s.prompts[turn[cell] % len(s.prompts)]
        turn[cell] += 1
        if cache == COLD_1:
            prompt = prompt[
                :1
            ]  # nothing to load before decode starts: every layer's first use misses
        om = warm[(link, name)] if cache == "warm" else _engine(s, link, named[name], False)
        module = om.adapter_prefetcher.adapter if om.adapter_prefetcher is not None else None
        spent = (getattr(module, "seconds", 0.0), getattr(module, "calls", 0))
        try:
            r = run_cell(om, plain, [prompt], s.tokens)
        finally:
            if cache == "cold":
                om.close()
        st = r.pop("stats")
        row = {
            "tok_s": r["tok_s"],
            "stall_share": r["stall_share"],
            "hit_rate": st["hit_rate"],
            "prefetch_used": st["prefetch_used"],
            "prefetch_issued": st["prefetch_issued"],
        }
        if hasattr(module, "calls"):  # a predictor with a model of its own: what its forwards cost
            calls = module.calls - spent[1]
            row["draft_ms"] = 1e3 * (module.seconds - spent[0]) / max(1, calls)
        return row

    try:
        res = interleaved(cells, s.rounds, one)
    finally:
        for om in warm.values():
            om.close()
    out = []
    for link, cache, name in cells:
        keys = (*KEYS, "draft_ms") if "draft_ms" in res[(link, cache, name)][0] else KEYS
        med = summarize(res, (link, cache, name), (link, cache, NONE), keys)
        # Every round's ratio, so the page can show the spread the shared machine leaves.
        ratios = [
            a["tok_s"] / b["tok_s"]
            for a, b in zip(res[(link, cache, name)], res[(link, cache, NONE)])
        ]
        out.append(
            {
                "link": link or "disk",
                "cache": cache,
                "predictor": name,
                "vs_none": med.pop("ratio"),
                "round_ratios": ratios,
                **med,
            }
        )
    return out


def sim_profiles(model_shape: str, link: str) -> dict[str, Costs]:
    """This machine's measured disk profile, the same behind the emulated `link` (its bandwidth
    caps the disk's, its latency adds), and the phone profile (UFS 3.1: the paper's class)."""
    disk = costs_for("this-machine-disk", model_shape)
    mb_s, lat_us = NAMED_LINKS[link]
    slow = replace(
        disk,
        profile=f"this-machine-disk + {link}",
        link_mb_per_s=min(disk.link_mb_per_s, mb_s),
        link_latency_s=disk.link_latency_s + lat_us * 1e-6,
    )
    # The same disk with its transfers' CPU time (reads, conversion into a slot) taken off the
    # compute thread, as DMA copies would be: what a wrong prefetch costs here, and nowhere else.
    free = replace(disk, profile="this-machine-disk, per_load_s = 0", per_load_s=0.0)
    return {
        "this machine, disk": disk,
        f"this machine, disk + {link}": slow,
        "this machine, disk, loads off the compute thread": free,
        "phone (UFS 3.1)": costs_for("phone-ufs31", model_shape),
    }


def _slice(trace: dict, a: int, b: int) -> dict:
    return {
        **{k: v[a:b] for k, v in trace.items() if isinstance(v, np.ndarray) and v.ndim},
        "meta": trace["meta"],
    }


def _replay(trace: dict, costs: Costs, cfg: SimSettings, ranked: np.ndarray | None) -> dict:
    pol = EngineConfig(policy="fetch-all").policies()
    pred = TablePredictor(ranked) if ranked is not None else None
    return Simulator(trace, pol, costs, replace(cfg, predictor=pred)).run().to_dict()


def _cold(
    trace: dict,
    costs: Costs,
    cache_fraction: float,
    starts: list[int],
    prompt: int,
    tokens: int,
    ranked: np.ndarray | None,
) -> float:
    """Simulated tok/s over requests of `prompt` + `tokens` trace rows from `starts`, each from an
    empty fast tier, the prompt replayed untimed."""
    tok = secs = 0.0
    for a in starts:
        c = _replay(
            _slice(trace, a, a + prompt + tokens),
            costs,
            SimSettings(cache_fraction=cache_fraction, warm=False, prompt_tokens=prompt),
            ranked[a : a + prompt + tokens] if ranked is not None else None,
        )
        tok, secs = tok + c["tokens"], secs + c["tokens"] / c["tokens_per_s"]
    return tok / secs if secs else float("nan")


def simulated(
    arrays: dict,
    ranked: dict[str, np.ndarray],
    profiles: dict[str, Costs],
    cache_fraction: float,
    prompt: int,
    tokens: int,
    requests: int,
) -> list[dict[str, Any]]:
    """SIMULATED tok/s per (profile, cache, predictor). Warm: the whole held-out trace in one
    replay (its fast tier carries over). Cold: `requests` requests of `prompt` + `tokens` trace
    rows, each from an empty fast tier; the prompt is replayed untimed, as the engine's prefill."""
    trace = trace_from_arrays(arrays)
    n = int(trace["ids"].shape[0])
    span = prompt + tokens
    starts = [i * span for i in range(min(requests, n // span))]
    named: dict[str, np.ndarray | None] = {NONE: None, **ranked}
    out = []
    for pname, costs in profiles.items():
        for name, r in named.items():
            w = _replay(trace, costs, SimSettings(cache_fraction=cache_fraction), r)
            cold = {
                cache: _cold(trace, costs, cache_fraction, starts, p, tokens, r)
                for cache, p in (("cold", prompt), (COLD_1, 1))
            }
            for cache, tok_s, stall in (
                ("warm", w["tokens_per_s"], w["stall_share"]),
                *((c, t, None) for c, t in cold.items()),
            ):
                out.append(
                    {
                        "profile": pname,
                        "cache": cache,
                        "predictor": name,
                        "tok_s": tok_s,
                        "stall_share": stall,
                        "prefetch_precision": w["prefetch_precision"] if cache == "warm" else None,
                    }  # fmt: skip
                )
    for row in out:  # ratio to no prefetch on the same profile and cache
        base = next(
            b
            for b in out
            if (b["profile"], b["cache"], b["predictor"]) == (row["profile"], row["cache"], NONE)
        )
        row["vs_none"] = row["tok_s"] / base["tok_s"]
    return out


def bandwidth_sweep(
    arrays: dict,
    ranked: dict[str, np.ndarray],
    disk: Costs,
    cache_fraction: float,
    mb_per_s: tuple[float, ...],
    max_tokens: int,
) -> dict[str, list[float]]:
    """SIMULATED warm-cache speed-up over no prefetch per predictor against the link's bandwidth,
    the profile's compute and latency held, over the first `max_tokens` rows: where prefetching
    pays and where the storage is fast enough to need none (the paper's NVMe)."""
    trace = trace_from_arrays(arrays)
    cfg = SimSettings(cache_fraction=cache_fraction, max_tokens=max_tokens)
    out: dict[str, list[float]] = {"mb_per_s": list(mb_per_s)}
    base = [
        _replay(trace, replace(disk, link_mb_per_s=bw), cfg, None)["tokens_per_s"]
        for bw in mb_per_s
    ]
    for name, r in ranked.items():
        out[name] = [
            _replay(trace, replace(disk, link_mb_per_s=bw), cfg, r)["tokens_per_s"] / b
            for bw, b in zip(mb_per_s, base)
        ]
    return out
