"""gpt-oss's MXFP4 experts through the native kernel (engine/native/mxfp4_moe.c, engine/experts/compute/native_mxfp4.py):
the torch path's arithmetic (dequantize, then GptOssKernel) within float rounding in every build this CPU runs,
each row's result bit for bit the one it gets alone, and the engine's tokens independent of where an expert was
(resident, fetched into a slot, or run from the host tier by a CPU worker)."""

from __future__ import annotations

import pytest
import torch

from engine.experts.compute.native_mxfp4 import NativeMxfp4Moe, native_experts
from engine.experts.formats.expert_kernels import GptOssKernel
from engine.experts.formats.native_quant import Mxfp4GptOssFormat
from engine.native.loaded import load_build, native
from engine.native.row_kernels import native_rows
from engine.native.variants import runnable

pytestmark = pytest.mark.skipif(
    native() is None, reason="needs the native CPU kernels (a C compiler)"
)
H, I = 96, 64  # multiples of 32, H != I so that a transposition cannot pass
ALPHA, LIMIT = 1.702, 7.0


def _expert(fmt: Mxfp4GptOssFormat, g: torch.Generator) -> torch.Tensor:
    """One random slot: biases, then blocks and scales (scales near 2^-5 keep the clamp in play)."""
    parts = []
    for dtype, shape in [(p[2], p[3]) for p in fmt._parts]:
        if dtype == "uint8" and len(shape) == 3:
            parts.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).flatten())
        elif dtype == "uint8":
            parts.append(torch.randint(122, 127, shape, generator=g, dtype=torch.uint8).flatten())
        else:
            b = (torch.randn(shape, generator=g) * 0.5).to(getattr(torch, dtype))
            parts.append(b.view(torch.uint8).flatten())
    return torch.cat(parts)


def _setup(dtype: torch.dtype, n: int = 4):  # noqa: ANN202
    fmt = Mxfp4GptOssFormat(GptOssKernel(H, I, ALPHA, LIMIT), H, I, "bfloat16", str(dtype)[6:])
    g = torch.Generator().manual_seed(0)
    slots = [_expert(fmt, g) for _ in range(n)]
    return fmt, slots, [fmt.views(s) for s in slots], g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("build", [v.name for v in runnable()])
def test_moe_mxfp4_is_the_torch_path_and_rows_compute_alone(build: str, dtype: torch.dtype) -> None:
    kernels, why = load_build(build)
    assert kernels is not None, why
    fmt, _, views, g = _setup(dtype)
    moe = NativeMxfp4Moe(kernels, fmt, H, I)
    ptrs = [moe.pointers(v) for v in views]
    x = (torch.randn(5, H, generator=g) * 2).to(dtype)
    ids = [0, 2, 1, 2, 3, 0, 1, 3, 2, 3]  # k = 2 per row
    w = torch.rand(10, generator=g).to(dtype).float().tolist()
    got = kernels.moe_mxfp4(x, H, I, ptrs, ids, w, torch.bfloat16, ALPHA, LIMIT)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for r in range(5):
        alone = kernels.moe_mxfp4(
            x[r : r + 1], H, I, ptrs, ids[2 * r : 2 * r + 2], w[2 * r : 2 * r + 2],
            torch.bfloat16, ALPHA, LIMIT,
        )  # fmt: skip
        assert torch.equal(got[r : r + 1], alone)
        # the torch path: dequantize, GptOssKernel, scale and sum in ascending id, in the compute dtype
        ref = None
        for j in sorted(range(2), key=lambda j: ids[2 * r + j]):
            e = ids[2 * r + j]
            y = fmt.forward(views[e], x[r : r + 1])
            v = (y * torch.tensor(w[2 * r + j], dtype=dtype)).to(dtype)
            ref = v if ref is None else ref + v
        assert ref is not None
        scale = ref.float().abs().max().item()
        assert (got[r : r + 1].float() - ref.float()).abs().max().item() <= tol * scale
    # one expert over several rows (NativeMoe.rows): each row as it computes alone
    many = moe.rows(x, ptrs[1])
    for r in range(5):
        assert torch.equal(many[r : r + 1], moe.rows(x[r : r + 1].clone(), ptrs[1]))


def test_the_clamp_and_the_biases_take_part() -> None:
    """A weight scale large enough that gate and up pass the limit: the kernel still follows the torch path."""
    kernels = native()
    assert kernels is not None
    fmt = Mxfp4GptOssFormat(GptOssKernel(H, I, ALPHA, LIMIT), H, I, "float32", "float32")
    g = torch.Generator().manual_seed(1)
    slot = _expert(fmt, g)
    views = fmt.views(slot)
    views[3].fill_(129)  # gate_up scales 2^2: |gate|, |up| far past 7
    x = torch.randn(1, H, generator=g)
    gu = x @ fmt.weights(views)[0] + views[0].float()
    assert (gu.abs() > LIMIT).float().mean() > 0.3
    moe = NativeMxfp4Moe(kernels, fmt, H, I)
    got = moe.rows(x, moe.pointers(views))
    ref = fmt.forward(views, x)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_native_experts_picks_the_mxfp4_kernel_and_declines_other_shapes() -> None:
    fmt = Mxfp4GptOssFormat(GptOssKernel(H, I, ALPHA, LIMIT), H, I, "bfloat16", "bfloat16")
    assert isinstance(native_experts(fmt, H, I), NativeMxfp4Moe)
    odd = Mxfp4GptOssFormat(GptOssKernel(H, 48, ALPHA, LIMIT), H, 48, "bfloat16", "bfloat16")
    assert native_experts(odd, H, 48) is None  # I not a multiple of 32: the torch path
    moe = native_experts(fmt, H, I)
    assert moe is not None
    x = torch.randn(2, H).bfloat16()
    assert moe.accepts(x) and not moe.accepts(x.float())  # the compute dtype only
    with native_rows(False):  # a step of prompt rows: torch
        assert not moe.accepts(x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_do_not_depend_on_where_the_experts_were(
    tiny_ckpt, tmp_path, monkeypatch, dtype: str
) -> None:
    """Every expert resident, a partial fast tier (fetched slots) and CPU workers on the host tier: the same
    tokens and logprobs bit for bit, each through the native kernel; in f32 the tokens are transformers'."""
    from test_native_quant import mxfp4_checkpoints
    from tiny_models import load_reference

    from engine.config import EngineConfig
    from engine.core.completion import generate
    from engine.worker.loader import load_model
    from engine.worker.sampling import SamplingParams

    qdir, fdir = mxfp4_checkpoints(tiny_ckpt, tmp_path)
    calls = {"n": 0}
    call = NativeMxfp4Moe._call

    def counted(self, *a):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        return call(self, *a)

    monkeypatch.setattr(NativeMxfp4Moe, "_call", counted)
    ids = torch.randint(3, 200, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = []
    for kw in (
        dict(cache_fraction=1.0),
        dict(cache_fraction=0.3, offload="ram"),
        dict(cache_fraction=0.3, offload="disk", cpu_experts="all"),
    ):
        om = load_model(qdir, EngineConfig(dtype=dtype, **kw))
        try:
            assert isinstance(om.executor.native_moe, NativeMxfp4Moe)
            assert "native MXFP4" in om.plan.to_dict()["expert kernel"]["chosen"]
            calls["n"] = 0
            out = generate(om, ids, SamplingParams(max_tokens=10, min_tokens=10), logprobs=3)
            assert calls["n"] >= 9, kw  # the decode steps' experts ran natively
            runs.append((out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]))
        finally:
            om.close()
    assert runs[0] == runs[1] == runs[2]
    if dtype == "float32":
        ref = load_reference(fdir)
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False
            )[0, len(ids) :].tolist()
        assert runs[0][0] == want
