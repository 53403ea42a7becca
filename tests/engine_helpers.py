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
