"""greedy_tokens (one reduction for a step's plain greedy rows) gives each row exactly greedy_token's
answer: ties, NaN, +inf and -inf rows included, in every logits dtype the engine samples from."""

from __future__ import annotations

import pytest
import torch

from engine.worker.sampling import greedy_token, greedy_tokens


def _rows_one_by_one(logits: torch.Tensor) -> list[int | str]:
    out: list[int | str] = []
    for row in logits:
        try:
            out.append(greedy_token(row))
        except ValueError as e:
            out.append(str(e))
    return out


def _batched(logits: torch.Tensor) -> list[int | str]:
    return [t if isinstance(t, int) else str(t) for t in greedy_tokens(logits)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_rows_with_ties_nan_and_infinities(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        R, V = 8, 1000 + 37 * trial  # vocabularies that end mid vector
        x = torch.randn(R, V, generator=g).to(dtype)
        for r in range(R):
            kind = (trial + r) % 7
            top = x[r].max()
            if kind == 1:  # ties for the maximum, spread over the row (SIMD lanes, blocks)
                idx = torch.randint(0, V, (5,), generator=g)
                x[r, idx] = top + 1
            elif kind == 2:  # NaN in the row, the maximum elsewhere
                x[r, torch.randint(0, V, (3,), generator=g)] = float("nan")
            elif kind == 3:  # +inf twice: the first one wins
                x[r, torch.randint(0, V, (2,), generator=g)] = float("inf")
            elif kind == 4:  # every logit -inf but one
                x[r] = float("-inf")
                x[r, int(torch.randint(0, V, (1,), generator=g))] = 0.0
            elif kind == 5:  # NaN and -inf only, one finite logit
                x[r] = float("nan")
                x[r, : V // 2] = float("-inf")
                x[r, V - 3] = -1e4
            elif kind == 6:  # a row of the same value: token 0
                x[r] = 1.5
        assert _batched(x) == _rows_one_by_one(x), f"trial {trial} ({dtype})"


def test_a_row_nothing_can_be_sampled_from_fails_alone() -> None:
    x = torch.randn(3, 64)
    x[1] = float("nan")
    x[2, :] = float("-inf")
    out = greedy_tokens(x)
    assert out[0] == greedy_token(x[0])
    assert isinstance(out[1], ValueError) and isinstance(out[2], ValueError)
    assert "every logit is NaN or -inf" in str(out[1])
