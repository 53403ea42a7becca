"""--dense-quant int8 (engine/native/quant_linear.py): attention projections, shared-expert MLPs and lm_head
held as int8 per output channel. Its logits stay close to the unquantized model's; every forward runs it
(transformers', lean, fused; the native kernels on or off); and batching, speculation and prefix caching give
the greedy tokens of plain decoding with the same setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.completion import complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.errors import ConfigError
from engine.native.loaded import native
from engine.native.quant_linear import QuantLinear, quantize_dense, quantize_rows
from engine.native.row_kernels import native_rows
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.worker.lean_forward import LeanForward
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams

needs_native = pytest.mark.skipif(
    native() is None, reason="needs the native CPU kernels (a C compiler)"
)


def test_quantize_rows_is_round_to_nearest_per_row() -> None:
    w = (
        torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
        * torch.linspace(0.01, 3, 24)[:, None]
    )
    w[5] = 0.0  # a zero row: scale 0, codes 0, no division by zero
    q, s = quantize_rows(w)
    assert (
        q.dtype == torch.int8
        and s.dtype == torch.float16
        and q.shape == w.shape
        and s.shape == (24,)
    )
    assert int(q.abs().max()) <= 127 and bool((q[5] == 0).all()) and float(s[5]) == 0.0
    err = (q.float() * s.float()[:, None] - w).abs()
    assert bool((err <= s.float()[:, None] / 2 * 1.0001 + 1e-12).all())  # half a step, each weight
    assert int(q.abs().amax(dim=1)[torch.arange(24) != 5].min()) >= 126  # the scale uses the range


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_linear_rows_compute_as_one_row_does(dtype: torch.dtype) -> None:
    """Up to 16 rows in one native call: each row's result is the one it gets alone (what keeps a verification
    window exact); both kernels stay close to the float linear."""
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(192, 80, bias=True).to(dtype)
    with torch.no_grad():
        lin.bias.copy_(torch.randn(80, generator=g))
    ql = QuantLinear(lin)
    x = torch.randn(16, 192, generator=g).to(dtype)
    with torch.no_grad():
        together = ql(x)
        alone = torch.cat([ql(x[i : i + 1]) for i in range(16)])
        assert torch.equal(together, alone)
        ref = lin(x).float()
        with native_rows(False):  # torch's path: (x q^T) * s
            torch_path = ql(x).float()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    scale = ref.abs().max()
    assert (together.float() - ref).abs().max() <= tol * scale
    assert (torch_path - ref).abs().max() <= tol * scale


def test_quantize_dense_replaces_the_dense_linears_only() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4)  # a router
            self.experts = nn.ModuleList([nn.ModuleDict({"up_proj": nn.Linear(8, 8)})])
            self.shared_expert = nn.ModuleDict({"up_proj": nn.Linear(8, 8)})
            self.shared_expert_gate = nn.Linear(8, 1)

    model = nn.Module()
    model.attn, model.mlp, model.lm_head = Attn(), Mlp(), nn.Linear(8, 16)
    assert quantize_dense(model, "none") == 0
    assert quantize_dense(model, "int8") == 4
    assert isinstance(model.attn.q_proj, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    assert isinstance(model.mlp.shared_expert.up_proj, QuantLinear)
    assert type(model.mlp.gate) is nn.Linear and type(model.mlp.shared_expert_gate) is nn.Linear
    assert type(model.mlp.experts[0].up_proj) is nn.Linear


def test_bad_dense_quant_is_one_line() -> None:
    with pytest.raises(ConfigError, match="dense_quant must be 'none' or 'int8'"):
        EngineConfig(dense_quant="int4")


def _cfg(**kw) -> EngineConfig:  # noqa: ANN003
    return EngineConfig(cache_fraction=1.0, dtype="bfloat16", dense_quant="int8", **kw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_dense_int8_logits_close_to_the_unquantized_model(tiny_ckpt, arch: str) -> None:
    ids = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype="bfloat16"))
    om = load_model(tiny_ckpt(arch), _cfg())
    try:
        want, got = prompt_logits(ref, ids).float(), prompt_logits(om, ids).float()
        layer = om.model.model.layers[0]
        assert isinstance(layer.self_attn.q_proj, QuantLinear) and isinstance(
            om.model.lm_head, QuantLinear
        )
        if arch == "qwen2_moe":
            assert isinstance(layer.mlp.shared_expert.down_proj, QuantLinear)
        assert om.plan.to_dict()["dense weights"]["chosen"] == "int8"
        assert ref.plan.to_dict()["dense weights"]["chosen"] == "none"
        # int8 per row: about 0.4 % per weight; the tiny model's logits stay within a few percent of their range
        assert (got - want).abs().max() <= 0.05 * want.abs().max(), (got - want).abs().max()
        assert not torch.equal(got, want)  # the quantized weights were used
    finally:
        ref.close()
        om.close()


@needs_native
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
def test_fused_decode_reads_int8_projections(tiny_ckpt, arch: str) -> None:
    """The fused step (decode_layer.c with row scales) computes what the layer-by-layer path does with the
    same int8 weights: the same greedy tokens (qwen3_moe: the same logits)."""
    from test_fused_decode import _decode

    om = load_model(tiny_ckpt(arch), _cfg(expert_quant="int8"))
    try:
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)  # the first-call checks
        want, _ = _decode(lean, om.config, fused=False)
        got, _ = _decode(lean, om.config, fused=True)
        assert lean._fused.state == "ready", lean._fused.why
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if arch == "qwen3_moe":
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got.float(), want.float(), rtol=0, atol=3e-2)
    finally:
        om.close()


def _core(om, spec: str, running: int) -> EngineCore:  # noqa: ANN001
    proposer, observers = make_speculation(
        SpecConfig(speculative=spec, adaptive=False).resolve(om.model_dir), om
    )
    return EngineCore.for_model(
        om, CoreLimits(max_running=running, max_model_len=512), proposer, observers
    )


def _core(om, spec: str, running: int) -> EngineCore:  # noqa: ANN001
    proposer, observers = make_speculation(
        SpecConfig(speculative=spec, adaptive=False).resolve(om.model_dir), om
    )
    return EngineCore.for_model(
        om, CoreLimits(max_running=running, max_model_len=512), proposer, observers
    )


def _tokens(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    outs = complete(
        core,
        [core.local_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts],
    )
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@needs_native
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_batching_speculation_and_prefix_cache_are_exact(tiny_ckpt, arch: str) -> None:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 200, (48,), generator=g).tolist()
    # a repeated tail so that n-gram speculation proposes; a shared prefix of whole prefix-cache blocks
    prompts = [shared + torch.randint(3, 200, (8,), generator=g).tolist() * 2 for _ in range(4)]
    plain_om = load_model(tiny_ckpt(arch), _cfg(prefix_cache_bytes=0))
    om = load_model(tiny_ckpt(arch), _cfg())
    try:
        plain = [_tokens(_core(plain_om, "off", 1), [p])[0] for p in prompts]
        core = _core(om, "ngram", 4)
        assert _tokens(core, prompts[:1]) == plain[:1]  # fills the prefix cache
        assert _tokens(core, prompts) == plain  # batched, speculative, prefix hits
        s = om.stats.snapshot()
        assert s["spec_drafts"] > 0, s["spec_drafts"]
        blocks = core.scheduler.blocks  # the paged pool: prefix blocks shared by reference
        assert blocks is not None and blocks.cache_prefixes and blocks.hit_tokens >= 4 * len(shared)
    finally:
        plain_om.close()
        om.close()
