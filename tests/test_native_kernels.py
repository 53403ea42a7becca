"""The native CPU kernels (engine/native/): built on this machine, equal to torch's arithmetic within
the documented rounding, independent of the thread count, and used by the engine without changing
what it decodes. Every kernel test runs once per build this CPU executes (engine/native/variants.py:
AVX-512 with BF16/VNNI, AVX-512, AVX2, portable); every build compiles on any x86-64 machine
(tests/test_native_variants.py). Speeds are in docs/benchmarks/kernels.md, not here."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from tiny_models import load_reference

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.experts.compute.native_moe import NativeMoe
from engine.native import build as native_build
from engine.native.kernels import MAX_ROWS
from engine.native.layers import NativeLinear, NativeRMSNorm, accelerate
from engine.native.loaded import load_build, native
from engine.native.variants import runnable
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine_nk():
    """The process's kernels (native()), for tests of the engine's use of them rather than of one build."""
    kernels = native()
    assert kernels is not None or native_build.compiler() is None, native_build.build()[1]
    if kernels is None:
        pytest.skip("no C compiler on this machine: the engine runs torch's kernels")
    return kernels


@pytest.fixture(scope="module", params=[v.name for v in runnable()])
def nk(request):
    if native_build.compiler() is None:
        pytest.skip("no C compiler on this machine: the engine runs torch's kernels")
    kernels, why = load_build(request.param)
    # Every CI and developer machine has gcc (the README's setup): a failed build must fail here, not skip.
    assert kernels is not None, why
    return kernels


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.abs().amax(1) / 127).half()
    q = (w / s.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, s


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.float()[:, None]


@pytest.mark.parametrize(
    "rows,cols,m", [(64, 128, 1), (37, 70, 3), (256, 192, MAX_ROWS), (5, 64, 2)]
)
def test_gemv_f32_and_bf16_equal_torch(nk, rows: int, cols: int, m: int) -> None:
    g = torch.Generator().manual_seed(rows + cols)
    w, x = torch.randn(rows, cols, generator=g), torch.randn(m, cols, generator=g)
    torch.testing.assert_close(nk.gemv(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    wb, xb = w.bfloat16(), x.bfloat16()
    # bf16 x bf16 products are exact in f32; only the f32 sum's order and the final rounding differ.
    exact = xb.double() @ wb.double().T
    got = nk.gemv(xb, wb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-6)
    # An f32 activation against bf16 weights keeps exact products (the weights are widened).
    torch.testing.assert_close(nk.gemv(x, wb), x @ wb.float().T, rtol=1e-5, atol=1e-5)


def test_gemv_int8_rows(nk) -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 256, generator=g), torch.randn(4, 256, generator=g)
    q, s = _int8_rows(w)
    ref = x @ _dequant(q, s).T
    # f32 activation: exact products with the dequantized weights.
    torch.testing.assert_close(nk.gemv(x, q, s), ref, rtol=1e-5, atol=1e-4)
    # bf16 activation: quantized to int8 in blocks of 64 where VNNI runs (documented: ~0.5 % relative).
    got = nk.gemv(x.bfloat16(), q, s).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.02, rel
    assert not torch.equal(got, torch.zeros_like(got))
    # Columns that are not a multiple of the 64-wide block: the activation is not quantized (widened path).
    w2, x2 = torch.randn(40, 96, generator=g), torch.randn(2, 96, generator=g).bfloat16()
    q2, s2 = _int8_rows(w2)
    torch.testing.assert_close(
        nk.gemv(x2, q2, s2).float(), x2.float() @ _dequant(q2, s2).T, rtol=2**-7, atol=1e-2
    )


def test_gemv_int4_groups(nk) -> None:
    from engine.experts.formats.quant import quantize_int4

    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(72, 256, generator=g), torch.randn(3, 256, generator=g).bfloat16()
    packed, s, z = quantize_int4(w, 64)  # [72, 4, 32] codes, [72, 4, 1] scales and zeros
    packed, s, z = (
        packed.reshape(72, -1).contiguous(),
        s.to(torch.float16).contiguous(),
        z.to(torch.float16).contiguous(),
    )
    q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).float().view(72, 4, 64)
    deq = ((q - z.float()) * s.float()).view(72, 256)
    ref = x.float() @ deq.T
    got = nk.gemv_q4(x, packed, s, z)
    assert got is not None  # every build has an int4 kernel (VNNI, AVX2's vpmaddubsw, or plain C)
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.02, rel
    assert (
        nk.gemv_q4(x.float(), packed, s, z) is None
    )  # f32 activations keep the exact dequantizing path
    assert (
        nk.gemv_q4(x[:, :200].contiguous(), packed[:, :100].contiguous(), s, z) is None
    )  # not a multiple of 64


def test_int4_expert_format_runs_natively_in_bf16(engine_nk) -> None:
    from engine.experts.formats.expert_kernels import SwiGLUKernel
    from engine.experts.formats.native_quant import FORMATS

    H, I = 128, 64
    fmt = FORMATS.make(SwiGLUKernel(H, I, torch.nn.SiLU()), "int4", 64, "bfloat16")
    g = torch.Generator().manual_seed(9)
    views = fmt.views(
        fmt.encode([torch.randn(2 * I, H, generator=g) / 8, torch.randn(H, I, generator=g) / 8])
    )
    x = torch.randn(2, H, generator=g).bfloat16()
    fast = fmt.forward(views, x)
    slow = fmt.kernel.forward(fmt.weights(views), x)  # dequantize, then torch
    assert fast.dtype == slow.dtype == torch.bfloat16
    assert ((fast.float() - slow.float()).norm() / slow.float().norm()).item() < 0.04
    # The native kernel ran (the activation quantized): not the dequantizing path's result.
    assert not torch.equal(fast, slow)


def test_gemv_results_do_not_depend_on_threads(nk) -> None:
    g = torch.Generator().manual_seed(5)
    w, x = (
        torch.randn(300, 512, generator=g).bfloat16(),
        torch.randn(3, 512, generator=g).bfloat16(),
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = nk.gemv(x, w)
        torch.set_num_threads(2)
        two = nk.gemv(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_gemv_rejects_no_rows(nk) -> None:
    with pytest.raises(ValueError, match="at least one row"):
        nk.gemv(torch.randn(0, 64), torch.randn(8, 64))


def _swiglu_reference(
    x: torch.Tensor, experts: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float]
) -> torch.Tensor:
    """transformers' order and rounding: each expert in x's dtype, scaled in f32, cast, summed in order."""
    out = None
    for (gate_up, down), w in zip(experts, weights):
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down)
        y = (y * torch.tensor(w)).to(x.dtype)
        out = y if out is None else out + y
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_equals_expert_by_expert(nk, dtype: torch.dtype) -> None:
    H, I, m = 128, 64, 6
    g = torch.Generator().manual_seed(11)
    experts = [
        (
            (torch.randn(2 * I, H, generator=g) / 8).to(dtype),
            (torch.randn(H, I, generator=g) / 8).to(dtype),
        )
        for _ in range(m)
    ]
    weights = torch.rand(m, generator=g).tolist()
    x = torch.randn(1, H, generator=g).to(dtype)
    got = nk.moe_swiglu(
        x,
        dtype,
        H,
        I,
        [gu.data_ptr() for gu, _ in experts],
        [d.data_ptr() for _, d in experts],
        weights,
    )
    ref = _swiglu_reference(x, experts, weights)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-6, atol=2e-3)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_fused_moe_results_do_not_depend_on_threads(nk) -> None:
    H, I, m = 256, 96, 8
    g = torch.Generator().manual_seed(13)
    experts = [
        (torch.randn(2 * I, H, generator=g).bfloat16(), torch.randn(H, I, generator=g).bfloat16())
        for _ in range(m)
    ]
    weights = torch.rand(m, generator=g).tolist()
    x = torch.randn(1, H, generator=g).bfloat16()
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(
                nk.moe_swiglu(
                    x,
                    torch.bfloat16,
                    H,
                    I,
                    [gu.data_ptr() for gu, _ in experts],
                    [d.data_ptr() for _, d in experts],
                    weights,
                )
            )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_fused_moe_int8(nk) -> None:
    H, I, m = 128, 64, 3
    g = torch.Generator().manual_seed(12)
    parts = [
        (
            _int8_rows(torch.randn(2 * I, H, generator=g) / 8),
            _int8_rows(torch.randn(H, I, generator=g) / 8),
        )
        for _ in range(m)
    ]
    weights = [0.5, 0.3, 0.2]
    x = torch.randn(1, H, generator=g)
    got = nk.moe_swiglu(
        x,
        torch.int8,
        H,
        I,
        [gu[0].data_ptr() for gu, _ in parts],
        [d[0].data_ptr() for _, d in parts],
        weights,
        [gu[1].data_ptr() for gu, _ in parts],
        [d[1].data_ptr() for _, d in parts],
    )
    ref = _swiglu_reference(x, [(_dequant(*gu), _dequant(*d)) for gu, d in parts], weights)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)  # f32 activation: exact products
    # bf16 activation: VNNI with the activation quantized in blocks of 64 (H = 128 and I = 64 both qualify).
    xb = x.bfloat16()
    got_b = nk.moe_swiglu(
        xb,
        torch.int8,
        H,
        I,
        [gu[0].data_ptr() for gu, _ in parts],
        [d[0].data_ptr() for _, d in parts],
        weights,
        [gu[1].data_ptr() for gu, _ in parts],
        [d[1].data_ptr() for _, d in parts],
    ).float()
    ref_b = _swiglu_reference(
        xb.float(), [(_dequant(*gu), _dequant(*d)) for gu, d in parts], weights
    )
    assert ((got_b - ref_b).norm() / ref_b.norm()).item() < 0.03


def test_native_linear_matches_f_linear(engine_nk) -> None:
    lin = NativeLinear.replacing(torch.nn.Linear(96, 40).bfloat16())
    x = torch.randn(1, 3, 96).bfloat16()
    ref = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(lin(x).float(), ref.float(), rtol=2**-6, atol=2e-2)
    # Past the kernel's 16 rows a call: still native, each row bit for bit what it gets alone
    # (batch-invariant), and within rounding of torch's.
    big = torch.randn(2, MAX_ROWS + 3, 96).bfloat16()
    got = lin(big)
    alone = torch.stack([torch.stack([lin(row[None])[0] for row in part]) for part in big])
    assert torch.equal(got, alone)
    torch.testing.assert_close(
        got.float(), F.linear(big, lin.weight, lin.bias).float(), rtol=2**-6, atol=2e-2
    )


def test_native_linear_keeps_its_descriptor_only_while_nothing_changed(engine_nk) -> None:
    """A NativeLinear keeps its last native call's weight descriptor (decode sends each projection the same
    rows every step); a weight replaced, refilled in new memory, a step on torch's kernels, rows of another
    dtype or width each take the general path again, whose result the kept one equals bit for bit."""
    from engine.native.row_kernels import native_rows

    g = torch.Generator().manual_seed(3)
    lin = NativeLinear.replacing(torch.nn.Linear(64, 24, bias=False))
    x = torch.randn(2, 64, generator=g)
    first = lin(x)  # the general path, which keeps the descriptor
    assert lin._kept is not None and torch.equal(lin(x), first)
    lin.weight = torch.nn.Parameter(torch.randn(24, 64, generator=g))  # another Parameter
    assert torch.equal(lin(x), torch.stack([lin(row[None])[0] for row in x]))
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    lin.weight.data = torch.randn(24, 64, generator=g)  # the same Parameter, new memory
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    with native_rows(False):
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert (
        lin(x.bfloat16()).dtype == torch.bfloat16
    )  # bf16 rows of an f32 layer: torch's widening path
    with pytest.raises(RuntimeError):
        lin(
            torch.randn(2, 32)
        )  # rows of another width fail as F.linear fails, never read past the weight


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_bf16_engine_decodes_like_transformers(engine_nk, tiny_ckpt, arch: str) -> None:
    """The bf16 decode path (native dense layers and fused experts) gives transformers' bf16 greedy tokens."""
    path = tiny_ckpt(arch)
    ref = load_reference(path).to(torch.bfloat16)
    ids = torch.randint(
        3, ref.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    with torch.no_grad():
        ref_tokens = ref.generate(
            torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(ids) :].tolist()
    for fraction in (1.0, 0.5):
        om = load_model(path, EngineConfig(cache_fraction=fraction, dtype="bfloat16"))
        try:
            assert isinstance(om.executor.native_moe, NativeMoe)
            assert any(isinstance(mod, NativeLinear) for mod in om.model.modules())
            assert (
                generate(om, ids, SamplingParams(max_tokens=16, min_tokens=16)).token_ids
                == ref_tokens
            ), fraction
        finally:
            om.close()


def test_without_a_compiler_the_build_says_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    lib, why = native_build.build()
    assert lib is None and "no C compiler" in why


def test_native_kernels_follow_the_engine_config(tiny_ckpt) -> None:
    """--native-kernels off: torch's kernels everywhere, said in the plan; on brings them back (auto follows
    a measurement: tests/test_native_variants.py)."""

    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=1.0, dtype="bfloat16", native_kernels="off"),
    )
    try:
        assert (
            om.native is not None and om.native.kernels is None and om.executor.native_moe is None
        )
        assert not any(isinstance(mod, NativeLinear) for mod in om.model.modules())
        assert om.plan.forward == "lean" and om.plan.to_dict()["native kernels"]["chosen"] == "off"
    finally:
        om.close()
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=1.0, dtype="bfloat16", native_kernels="on"),
    )
    try:
        assert (
            om.native is not None and om.native.kernels is not None and om.plan.forward == "fused"
        )
    finally:
        om.close()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to show a failing build")
def test_a_failing_build_says_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOE_OFFLOAD_CACHE", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native_build, "SOURCES", [bad])
    lib, why = native_build.build()
    assert (
        lib is None
        and why.startswith("building the native CPU kernels (")
        and "using torch's" in why
    )
    assert not list((tmp_path / "native").glob("*.so"))  # no half-built library left to load later


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rmsnorm_equals_the_module_it_replaces(engine_nk, dtype: torch.dtype) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm = Qwen3MoeRMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    ref = Qwen3MoeRMSNorm(96, eps=1e-6).to(dtype)
    ref.load_state_dict(norm.state_dict())
    parent = torch.nn.Sequential(norm)  # replaced in its parent, over the same weight
    assert accelerate(parent) == 1 and isinstance(parent[0], NativeRMSNorm)
    assert parent[0].weight is norm.weight and list(parent.state_dict()) == ["0.weight"]
    norm = parent[0]
    for _ in range(
        3
    ):  # the first call checks against the module's own forward, later ones run natively
        x = torch.randn(1, 2, 96).to(dtype)
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(norm(x).float(), ref(x).float(), rtol=tol, atol=tol)
    assert norm.verified is True
    big = torch.randn(3, MAX_ROWS, 96).to(dtype)  # any rows: native, each row as it is alone
    alone = torch.stack([torch.stack([norm(row[None])[0] for row in part]) for part in big])
    assert torch.equal(norm(big), alone)
    torch.testing.assert_close(norm(big).float(), ref(big).float(), rtol=tol, atol=tol)


def test_accelerate_replaces_modules_in_their_parents(engine_nk) -> None:
    """The native layers replace modules in their parents, over the same Parameters: no class swaps and
    no instance forwards; a module under two parents gets one counterpart, and a second call none."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    shared = torch.nn.Linear(8, 8).bfloat16()
    model = torch.nn.ModuleDict(
        {
            "a": torch.nn.Sequential(shared, Qwen3MoeRMSNorm(8)),
            "b": torch.nn.Sequential(shared),
            "f32": torch.nn.Linear(8, 8),  # f32 linears too (one row computes alike in any window)
            "f16": torch.nn.Linear(8, 8).half(),  # a dtype the kernels do not read keeps torch's
        }
    )
    keys = list(model.state_dict())
    assert accelerate(model) == 3
    new = model["a"][0]
    assert isinstance(new, NativeLinear) and model["b"][0] is new and new.weight is shared.weight
    assert type(shared) is torch.nn.Linear and isinstance(model["a"][1], NativeRMSNorm)
    assert isinstance(model["f32"], NativeLinear) and type(model["f16"]) is torch.nn.Linear
    assert list(model.state_dict()) == keys
    assert not any("forward" in vars(m) for m in model.modules())
    assert accelerate(model) == 0

    class BiasedRMSNorm(torch.nn.Module):  # more than a weight: it keeps its own module
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.bias = torch.nn.Parameter(torch.zeros(8))
            self.eps = 1e-6

    assert accelerate(torch.nn.Sequential(BiasedRMSNorm())) == 0


def test_a_norm_that_computes_differently_keeps_its_own_forward(engine_nk) -> None:
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RMSNorm,  # y = x * rsqrt(...) * (1 + w)
    )

    norm = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64))
    ref = Gemma3RMSNorm(64, eps=1e-6)
    ref.load_state_dict(norm.state_dict())
    parent = torch.nn.Sequential(norm)
    accelerate(parent)
    norm = parent[0]
    x = torch.randn(1, 64)
    assert torch.equal(norm(x), ref(x))
    assert norm.verified is False
    assert torch.equal(norm(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rot", [16, 8]
)  # full rotary (qwen3) and half of a 16-wide head (glm4's partial rotary)
def test_rope_equals_transformers(nk, dtype: torch.dtype, rot: int) -> None:
    """The rotary kernel rounds each product and sum as torch does: bit-equal to transformers'."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(5)
    N, hq, hk, d = 3, 4, 2, 16
    q, k = (
        torch.randn(1, N, hq, d, generator=g).to(dtype),
        torch.randn(1, N, hk, d, generator=g).to(dtype),
    )
    ang = torch.rand(1, N, rot // 2, generator=g) * 6.28
    cos, sin = (
        torch.cat([ang.cos(), ang.cos()], -1).to(dtype),
        torch.cat([ang.sin(), ang.sin()], -1).to(dtype),
    )
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got_q, got_k = (
        nk.rope(q.clone(), cos, sin).transpose(1, 2),
        nk.rope(k.clone(), cos, sin).transpose(1, 2),
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_equals_add_then_rmsnorm(nk, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x, a = torch.randn(2, 96, generator=g).to(dtype), torch.randn(2, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    total, normed = nk.add_rmsnorm(x, a, w, 1e-6)
    assert torch.equal(total, x + a)
    assert torch.equal(normed, nk.rmsnorm(x + a, w, 1e-6))
