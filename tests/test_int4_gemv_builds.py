"""The int4 gemv (groups of 64, engine/native/cpu_gemv.c `gemv_q4`) in every build this CPU runs: close to
torch's product with the dequantized weight, the builds within float rounding of each other (they share the
integer sums; only the order of the float sums differs), and each row's result the one it gets alone whatever
the row count (what keeps a verification window exact). Widths of 12, 21 and 32 groups: the AVX-512 row
reads the scales sixteen groups at a time, so a partial block, a full one plus a partial one, and two full."""

from __future__ import annotations

import pytest
import torch

from engine.experts.formats.quant import quantize_int4
from engine.native import build as native_build
from engine.native.loaded import load_build
from engine.native.variants import runnable

needs_cc = pytest.mark.skipif(native_build.compiler() is None, reason="needs a C compiler")
BUILDS = [v.name for v in runnable()]


def _weight(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.2, 2.0, cols)  # uneven group scales
    packed, s, z = quantize_int4(w, 64)
    packed = packed.reshape(rows, -1).contiguous()
    s, z = s.to(torch.float16).contiguous(), z.to(torch.float16).contiguous()
    q = (
        torch.stack((packed & 15, packed >> 4), dim=-1)
        .flatten(-2)
        .float()
        .view(rows, cols // 64, 64)
    )
    deq = ((q - z.float()) * s.float()).view(rows, cols)
    return packed, s, z, deq


@needs_cc
@pytest.mark.parametrize("cols", [768, 1344, 2048])
def test_every_build_computes_int4_rows_alike(cols: int) -> None:
    packed, s, z, deq = _weight(40, cols, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.float() @ deq.T
    results = {}
    for name in BUILDS:
        nk, why = load_build(name)
        assert nk is not None, why
        got = nk.gemv_q4(x, packed, s, z)
        assert got is not None
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 0.02, (name, rel)
        alone = torch.cat([nk.gemv_q4(x[i : i + 1].contiguous(), packed, s, z) for i in range(5)])
        assert torch.equal(got, alone), name  # each row as it computes alone
        results[name] = got.float()
    first = results[BUILDS[0]]
    for (
        name,
        got,
    ) in results.items():  # one bf16 ulp apart at most: the same integer sums in every build
        assert torch.allclose(got, first, rtol=2**-7, atol=1e-3 * float(ref.abs().max())), name
