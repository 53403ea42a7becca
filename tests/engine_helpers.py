"""Small helpers shared by the engine tests."""

from __future__ import annotations

import time

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
