"""Several activation rows in one native call compute each row bit for bit as that row alone does.

The kernels read each weight row once for all rows of a call (a batched decode step's rows, a
verification window) and dot_rows (engine/native/simd_*.h) loads and converts each weight chunk once
per block of rows; the exact policy needs each row's sums in the one-row order. So for every build
this CPU runs (the `nk` fixture of tests/test_native_kernels.py), m rows in one call (m = 1..16,
blocked and leftover rows alike, lengths that leave tails in every loop) must equal m one-row calls
exactly, and equal torch within rounding."""

from __future__ import annotations

import pytest
import torch
from test_native_kernels import _dequant, _int8_rows, nk  # noqa: F401 (nk: the per-build fixture)

from engine.native.kernels import MAX_ROWS

# Lengths hitting every loop of every build's dots: below one vector, one vector plus a tail, the
# 16-, 32- and 64-element steps with and without leftovers, and the embedded model's 256.
LENGTHS = (5, 17, 40, 70, 100, 129, 256)


def _one_by_one(nk, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None):  # noqa: F811
    return torch.cat([nk.gemv(x[j : j + 1], w, scale) for j in range(x.shape[0])])


@pytest.mark.parametrize("cols", LENGTHS)
@pytest.mark.parametrize(
    "wdtype,xdtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),  # f32 sums, unrounded: every bit of each row's sum shows
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_float_rows_equal_one_row_calls(
    nk,  # noqa: F811
    cols: int,
    wdtype: torch.dtype,
    xdtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(9, cols, generator=g).to(wdtype)
    # bf16 weights and bf16-valued f32 rows: the bf16 dot product's own path, with f32 results.
    x = torch.randn(MAX_ROWS, cols, generator=g).to(wdtype).to(xdtype)
    ref = x.double() @ w.double().T
    for m in range(1, MAX_ROWS + 1):
        got = nk.gemv(x[:m], w)
        assert torch.equal(got, _one_by_one(nk, x[:m], w)), (m, cols)
        tol = 1e-5 if xdtype == torch.float32 else 2**-7
        torch.testing.assert_close(got.double(), ref[:m], rtol=tol, atol=1e-4)


@pytest.mark.parametrize("cols", (64, 100, 192))
@pytest.mark.parametrize("xdtype", (torch.float32, torch.bfloat16))
def test_int8_rows_equal_one_row_calls(nk, cols: int, xdtype: torch.dtype) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(cols + 1)
    q, s = _int8_rows(torch.randn(11, cols, generator=g))
    x = torch.randn(MAX_ROWS, cols, generator=g).to(xdtype)
    ref = x.double() @ _dequant(q, s).double().T
    for m in range(1, MAX_ROWS + 1):
        got = nk.gemv(x[:m], q, s)
        assert torch.equal(got, _one_by_one(nk, x[:m], q, s)), (m, cols)
        # bf16 rows against int8 quantize the activation in blocks of 64 (~0.5 % relative, documented).
        rel = ((got.double() - ref[:m]).norm() / ref[:m].norm()).item()
        assert rel < (1e-6 if xdtype == torch.float32 else 0.02), (m, rel)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_expert_rows_equal_one_row_calls(nk, dtype: torch.dtype) -> None:  # noqa: F811
    """One SwiGLU expert over m rows (moe_swiglu_rows: gate_up then down, both through dot_rows) is each
    row's one-row result, and the SwiGLU computed in double within rounding."""
    hidden, inter = 96, 40  # tails in both projections' dots
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(dtype)
    slot = (gate_up.data_ptr(), 0, down.data_ptr(), 0)
    x = torch.randn(MAX_ROWS, hidden, generator=g).to(dtype)
    gu = x.double() @ gate_up.double().T
    ref = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ down.double().T
    for m in range(1, MAX_ROWS + 1):
        got = nk.expert_rows(x[:m], dtype, hidden, inter, slot)
        alone = torch.cat(
            [nk.expert_rows(x[j : j + 1], dtype, hidden, inter, slot) for j in range(m)]
        )
        assert torch.equal(got, alone), m
        tol = 1e-4 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(got.double(), ref[:m], rtol=tol, atol=tol)
