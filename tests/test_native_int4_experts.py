"""int4 experts (groups of 64) through one native call a layer (cpu_gemv.c's moe_q4_rows,
engine/experts/compute/native_moe.py): the arithmetic of the expert-by-expert gemv_q4 path, each row as it computes alone, in every
build this CPU runs; the fused decode step takes int4 experts; speculation and batching stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.experts.compute.native_moe import INT4
from engine.native.loaded import load_build, native
from engine.native.variants import runnable
from engine.worker.lean_forward import LeanForward
from engine.worker.loader import load_model

pytestmark = pytest.mark.skipif(
    native() is None, reason="needs the native CPU kernels (a C compiler)"
)
H, I = 128, 192  # multiples of 64, H != I so that a transposition cannot pass


def _int4(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (
        torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8),
        (torch.rand(rows, cols // 64, generator=g) * 0.02 + 0.001).half(),
        (torch.rand(rows, cols // 64, generator=g) * 15).half(),
    )


def _dequant(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    q = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2).float()  # [rows, cols], low nibble first
    rows, cols = q.shape
    return ((q.view(rows, cols // 64, 64) - z.float()[..., None]) * s.float()[..., None]).view(
        rows, cols
    )


def _slot(gu: tuple[torch.Tensor, ...], d: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (gu[0], gu[1], d[0], d[1], gu[2], d[2]))


@pytest.mark.parametrize("build", [v.name for v in runnable()])
def test_moe_q4_is_the_gemv_q4_path_and_rows_compute_alone(build: str) -> None:
    kernels, why = load_build(build)
    assert kernels is not None, why
    g = torch.Generator().manual_seed(0)
    experts = [(_int4(2 * I, H, g), _int4(H, I, g)) for _ in range(4)]
    slots = [_slot(gu, d) for gu, d in experts]
    x = torch.randn(5, H, generator=g).bfloat16()
    ids = [0, 2, 1, 2, 3, 0, 1, 3, 2, 3]  # k = 2 per row
    w = torch.rand(10, generator=g).tolist()
    got = kernels.moe_q4(x, H, I, slots, ids, w)
    for r in range(5):  # the row alone, and the expert-by-expert path with two gemv_q4 calls
        alone = kernels.moe_q4(
            x[r : r + 1], H, I, slots, ids[2 * r : 2 * r + 2], w[2 * r : 2 * r + 2]
        )
        assert torch.equal(got[r : r + 1], alone)
        acc = None
        for j in sorted(range(2), key=lambda j: ids[2 * r + j]):
            (gu, d), wt = experts[ids[2 * r + j]], w[2 * r + j]
            y = kernels.gemv_q4(x[r : r + 1], *gu)
            gate, up = y.chunk(2, dim=-1)
            out = kernels.gemv_q4((F.silu(gate) * up).contiguous(), *d)
            v = out * torch.tensor(wt).bfloat16()
            acc = v if acc is None else acc + v
        # silu: the C library's expf against torch's; a bf16 ulp or so where it rounds the other way
        assert torch.allclose(got[r : r + 1].float(), acc.float(), rtol=2e-2, atol=2e-2)
        # against float math on the dequantized weights (the activation's int8 blocks: ~1 % per dot)
        ref = torch.zeros(H)
        for j in range(2):
            (gu, d), wt = experts[ids[2 * r + j]], w[2 * r + j]
            gate, up = (x[r].float() @ _dequant(*gu).T).chunk(2)
            ref += wt * (F.silu(gate) * up) @ _dequant(*d).T
        assert (got[r].float() - ref).abs().max() <= 0.05 * ref.abs().max()


def _decode(lean: LeanForward, config, fused: bool):  # noqa: ANN001, ANN202
    from test_fused_decode import _decode as decode

    return decode(lean, config, fused)


def test_fused_decode_takes_int4_experts(tiny_ckpt, tmp_path) -> None:
    path = tiny_ckpt("qwen3_moe", hidden=H, moe_intermediate_size=I // 3)  # I = 64
    om = load_model(
        path,
        EngineConfig(
            cache_fraction=1.0, dtype="bfloat16", expert_quant="int4", quant_cache_dir=str(tmp_path)
        ),
    )
    try:
        assert om.executor.native_moe is not None and om.executor.native_moe.weight_dtype == INT4
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)  # first-call checks
        want, _ = _decode(lean, om.config, fused=False)
        got, _ = _decode(lean, om.config, fused=True)
        assert lean._fused.state == "ready", lean._fused.why
        assert torch.equal(got, want)  # the same kernels, layer by layer or in one call
    finally:
        om.close()


def test_int4_speculation_and_batching_are_exact(tiny_ckpt, tmp_path) -> None:
    from test_dense_quant import _core, _tokens

    path = tiny_ckpt("qwen3_moe", hidden=H, moe_intermediate_size=I // 3)
    cfg = dict(
        cache_fraction=1.0, dtype="bfloat16", expert_quant="int4", quant_cache_dir=str(tmp_path)
    )
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 200, (10,), generator=g).tolist() * 3 for _ in range(3)]
    plain_om = load_model(path, EngineConfig(prefix_cache_bytes=0, **cfg))
    om = load_model(path, EngineConfig(**cfg))
    try:
        plain_core = _core(plain_om, "off", 1)
        plain = [_tokens(plain_core, [p])[0] for p in prompts]
        assert _tokens(_core(om, "ngram", 3), prompts) == plain
        assert om.stats.snapshot()["spec_drafts"] > 0
    finally:
        plain_om.close()
        om.close()
