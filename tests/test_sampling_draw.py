"""engine/worker/sampling.py's draw: one index from non-negative weights, as torch.multinomial would."""

from __future__ import annotations

import torch
from engine_helpers import chi2_pvalue

from engine.worker.sampling import draw


def test_draws_follow_the_weights_and_skip_zeros() -> None:
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5])  # unnormalized: sums to 7
    g = torch.Generator().manual_seed(7)
    n = 20000
    counts = [0] * len(w)
    for _ in range(n):
        counts[draw(w, g)] += 1
    assert counts[0] == counts[2] == counts[5] == 0
    assert chi2_pvalue(counts, [n * float(x) / 7.0 for x in w]) > 0.01


def test_same_seed_same_draws_and_one_positive_weight() -> None:
    w = torch.softmax(torch.randn(151936, generator=torch.Generator().manual_seed(0)), -1)
    a = [draw(w, torch.Generator().manual_seed(3)) for _ in range(3)]
    b = [draw(w, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert a == b
    one = torch.zeros(10)
    one[6] = 1e-30
    assert {draw(one, torch.Generator().manual_seed(s)) for s in range(20)} == {6}


def test_bf16_weights() -> None:
    w = torch.tensor([0.25, 0.0, 0.75], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    got = [draw(w, g) for _ in range(2000)]
    assert 1 not in got and 0.2 < got.count(0) / 2000 < 0.3
