"""Many rows in one native call compute each row bit for bit as that row alone does (engine/native/gemm.c).

A prompt's rows go through gemm's register tiles, which share each load among several activation rows and
several weight rows and run the one-row dot product's accumulator chains one at a time over packed rows. The
engine's promise (issue 55) needs every row's result to be the one a single decode row gets, whatever number of
rows shares the call. So for every build this CPU runs and each weight/activation dtype pair: gemv over M rows
(M past the 16 that stay on the decode path, with leftover tiles) equals M one-row calls exactly, equals torch's
F.linear within rounding, and does not depend on the thread count; the SwiGLU expert step over R rows (routed to
several experts) equals R one-row calls exactly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from engine.native import build as native_build
from engine.native.kernels import NativeKernels
from engine.native.loaded import load_build
from engine.native.variants import runnable

MS = (1, 2, 5, 16, 17, 63, 200)
# Row lengths leaving a tail in every loop of every build's dot products: 1016 = 7 x 128 + 120 (the bf16 dot's
# 32-element chunks and scalar tail; the 16-element chunks; the even/odd dot's last 16-element block), 1021 (odd:
# scalar tails everywhere), 320 = 5 x 64 (int8 blocks in chains of unequal length).
COLS = (1016, 1021, 320)
PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),  # an f32 model's bf16 weights, widened
    (torch.bfloat16, torch.bfloat16),
    (torch.int8, torch.float32),
    (torch.int8, torch.bfloat16),  # the activation quantized in blocks of 64
]


@pytest.fixture(scope="module", params=[v.name for v in runnable()])
def nk(request) -> NativeKernels:
    if native_build.compiler() is None:
        pytest.skip("no C compiler on this machine: the engine runs torch's kernels")
    kernels, why = load_build(request.param)
    assert kernels is not None, why  # a failed build fails here, not skips
    return kernels


def _weight(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator):
    """(weight, int8 row scales or None, the weight as the kernels read it in f32)."""
    w = torch.randn(rows, cols, generator=g) / cols**0.5
    if dtype != torch.int8:
        return w.to(dtype), None, w.to(dtype).float()
    s = (w.abs().amax(1) / 127).half()
    q = (w / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, s, q.float() * s.float()[:, None]


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("wdtype,xdtype", PAIRS)
def test_gemm_rows_equal_one_row_calls(
    nk: NativeKernels, cols: int, wdtype: torch.dtype, xdtype: torch.dtype
) -> None:
    if wdtype == torch.int8 and cols % 64:
        cols = (
            cols // 64 * 64
        )  # the int8 dot's blocks (other lengths widen, as COLS' f32 cases test)
    g = torch.Generator().manual_seed(cols)
    w, scale, wf = _weight(
        37, cols, wdtype, g
    )  # 37 weight rows: a leftover column in every tile shape
    x = torch.randn(max(MS), cols, generator=g).to(xdtype)
    alone = torch.cat([nk.gemv(x[j : j + 1], w, scale) for j in range(max(MS))])
    ref = F.linear(x.float(), wf)
    for m in MS:
        got = nk.gemv(x[:m], w, scale)
        assert torch.equal(got, alone[:m]), (nk.variant, m)
        if xdtype == torch.float32:
            torch.testing.assert_close(got, ref[:m], rtol=1e-4, atol=1e-4)
        else:  # bf16 output rounding, and for int8 the activation's quantization (~0.5 %)
            rel = ((got.float() - ref[:m]).norm() / ref[:m].norm()).item()
            assert rel < (0.01 if wdtype == torch.int8 else 0.005), (nk.variant, m, rel)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_gemm_does_not_depend_on_threads(nk: NativeKernels) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 1016, generator=g).bfloat16()
    x = torch.randn(63, 1016, generator=g).bfloat16()
    results = []
    for n in (1, 2):
        with _threads(n):
            results.append(nk.gemv(x, w))
    assert torch.equal(*results)


@pytest.mark.parametrize("wdtype,xdtype", PAIRS[:1] + PAIRS[2:3] + PAIRS[4:])
def test_expert_rows_equal_one_row_calls(
    nk: NativeKernels, wdtype: torch.dtype, xdtype: torch.dtype
) -> None:
    """R rows, each routed to 2 of 4 experts (moe_swiglu_rows), against each row alone, then against the
    SwiGLU in f32 within rounding."""
    H, I, E, k = 256, 128, 4, 2
    g = torch.Generator().manual_seed(5)
    experts = [(_weight(2 * I, H, wdtype, g), _weight(H, I, wdtype, g)) for _ in range(E)]
    slots = [
        (
            gu[0].data_ptr(),
            gu[1].data_ptr() if gu[1] is not None else 0,
            d[0].data_ptr(),
            d[1].data_ptr() if d[1] is not None else 0,
        )
        for gu, d in experts
    ]
    R = 100
    x = torch.randn(R, H, generator=g).to(xdtype)
    ids = [int(e) for r in range(R) for e in sorted(torch.randperm(E, generator=g)[:k].tolist())]
    weights = torch.rand(R * k, generator=g).tolist()
    alone = torch.cat(
        [
            nk.moe_rows(
                x[r : r + 1],
                wdtype,
                H,
                I,
                slots,
                ids[r * k : r * k + k],
                weights[r * k : r * k + k],
            )
            for r in range(R)
        ]
    )
    for n in (1, 17, R):
        got = nk.moe_rows(x[:n], wdtype, H, I, slots, ids[: n * k], weights[: n * k])
        assert torch.equal(got, alone[:n]), (nk.variant, n)
    ref = torch.zeros(R, H)
    for r in range(R):
        for j in range(k):
            (_, _, gu), (_, _, d) = experts[ids[r * k + j]]
            gate, up = (x[r].float() @ gu.T).chunk(2)
            ref[r] += weights[r * k + j] * ((F.silu(gate) * up) @ d.T)
    rel = ((alone.float() - ref).norm() / ref.norm()).item()
    assert rel < (1e-5 if xdtype == torch.float32 else 0.03), (nk.variant, rel)
