"""Small helpers shared by the engine tests."""

from __future__ import annotations

import time
from typing import Any

import torch


def settle(om, seconds: float = 10.0) -> None:
    """Let transfers still in flight land: a load that was started keeps its slot pinned until it
    lands, even when the step that asked for it failed or finished. Only then is a leftover pin a leak."""
    deadline = time.monotonic() + seconds
    while om.transfers.pending() and time.monotonic() < deadline:
        time.sleep(0.01)


def chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularized upper gamma function."""
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(
        torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0), torch.tensor(stat / 2.0))
    )


def tokens_and_logprobs(core, reqs, after_step=None) -> list[list[tuple[int, float]]]:
    """Run `reqs` on an EngineCore to the end: each request's (token, logprob) pairs, in order; none may
    fail. `after_step()` runs after every step (to watch the engine's state)."""
    for r in reqs:
        core.add(r)
    out: dict[str, list[tuple[int, float]]] = {r.request_id: [] for r in reqs}
    while core.has_work():
        for o in core.step():
            assert o.error is None
            out[o.request_id] += [(t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs or [])]
        if after_step is not None:
            after_step()
    return [out[r.request_id] for r in reqs]


def greedy_in_engine_and_transformers(model_dir, ids: list[int], n: int) -> tuple[Any, list[int]]:
    """`n` greedy tokens after `ids` from the engine (fp32, cache 0.25 on disk) and the engine's
    result beside transformers' fp32 tokens (the reference)."""
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.core.completion import generate
    from engine.worker.loader import load_model
    from engine.worker.sampling import SamplingParams

    om = load_model(model_dir, EngineConfig(cache_fraction=0.25, offload="disk", dtype="float32"))
    try:
        res = generate(om, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        om.close()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expect = ref.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )[0, len(ids) :].tolist()
    return res, expect
