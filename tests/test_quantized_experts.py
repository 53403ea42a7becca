"""--expert-quant int8|int4: the engine equals transformers running the same dequantized weights,
and every byte it stores and moves is the quantized size."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_reference

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.errors import ConfigError
from engine.experts.formats.expert_kernels import SwiGLUKernel, make_kernel
from engine.experts.formats.native_quant import FORMATS
from engine.experts.formats.quant import GroupQuantFormat
from engine.weights.arch import arch_for
from engine.weights.moe_hook import expert_geometry, find_moe_sites
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams

# Kernel weight name -> the transformers experts parameter holding it (row e is expert e).
_PARAM = {
    "gate_up": "gate_up_proj",
    "gate_up_bias": "gate_up_proj_bias",
    "down": "down_proj",
    "down_bias": "down_proj_bias",
}
# SwiGLU, gpt-oss (biases, interleaved clamped SwiGLU, transposed) and Llama 4 (input scaling, transposed).
ARCHS = ("qwen3_moe", "gpt_oss", "llama4_text")


def _dequantized_reference(path, kind: str, group: int) -> torch.nn.Module:
    """The transformers model with every routed expert replaced by dequant(quant(expert))."""
    ref = load_reference(path)
    spec = arch_for(ref.config.model_type)
    with torch.no_grad():
        for site in find_moe_sites(ref):
            ex = site.block.experts
            E, H, I, _ = expert_geometry(site.block, transposed=spec.kernel != "swiglu")
            fmt = FORMATS.make(make_kernel(spec.kernel, ex, H, I), kind, group, "float32")
            for e in range(E):
                weights = [getattr(ex, _PARAM[name])[e] for name, _ in fmt.kernel.views]
                for p, w in zip(weights, fmt.weights(fmt.views(fmt.encode(weights)))):
                    p.copy_(w)
    return ref


def _prompt(vocab: int, n: int = 24) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_equals_transformers_on_dequantized_weights(
    tiny_ckpt, tmp_path, arch: str, kind: str
) -> None:
    path = tiny_ckpt(arch)
    ref = _dequantized_reference(
        path, kind, EngineConfig(expert_quant=kind).quant_group()
    )  # int8: whole rows, int4: 64
    plain = load_reference(path)
    ids = _prompt(ref.config.vocab_size)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref_logits = ref(x).logits[0]
        assert (
            plain(x).logits[0] - ref_logits
        ).abs().max() > 1e-4  # quantization really changed the model
        ref_tokens = ref.generate(x, max_new_tokens=12, min_new_tokens=12, do_sample=False)[
            0, len(ids) :
        ].tolist()
    for offload in ("ram", "disk"):
        cfg = EngineConfig(
            cache_fraction=0.5, offload=offload, expert_quant=kind, quant_cache_dir=str(tmp_path)
        )
        om = load_model(path, cfg)
        try:
            diff = (
                (prompt_logits(om, ids) - ref_logits).abs().max().item()
            )  # through the engine's runner
            assert diff <= 1e-4, f"{offload}: max |Δlogit| = {diff}"
            tokens = generate(om, ids, SamplingParams(max_tokens=12, min_tokens=12)).token_ids
            assert tokens == ref_tokens
            # Slots, transfers and byte counters all carry the quantized encoding.
            fmt = om.executor.fmt
            assert isinstance(fmt, GroupQuantFormat) and om.store.slots.dtype == torch.uint8
            assert (
                om.store.slot_bytes
                == fmt.slot_bytes
                == om.transfers.tier.expert_nbytes(om.moe_layers[0], 0)
            )
            assert fmt.slot_bytes < fmt.kernel.numel * 2 / (
                1.5 if kind == "int8" else 2.5
            )  # tiny shapes: small groups
            snap = om.stats.snapshot()
            assert (
                snap["misses"] > 0
                and snap["bytes_moved"] == snap["transfers"]["demand"] * fmt.slot_bytes
            )
        finally:
            om.close()


def test_sidecar_is_built_once_and_reused(tiny_ckpt, tmp_path) -> None:
    path = tiny_ckpt("qwen3_moe")
    cfg = EngineConfig(cache_fraction=0.5, expert_quant="int4", quant_cache_dir=str(tmp_path))
    load_model(path, cfg).close()
    (sidecar,) = tmp_path.glob("*.safetensors")
    stamp = sidecar.stat().st_mtime_ns
    load_model(path, cfg).close()
    assert list(tmp_path.glob("*.safetensors")) == [sidecar] and sidecar.stat().st_mtime_ns == stamp
    load_model(
        path, EngineConfig(cache_fraction=0.5, expert_quant="int8", quant_cache_dir=str(tmp_path))
    ).close()
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # another format is another file


@pytest.mark.parametrize("inter", [32, 64])
def test_bytes_per_expert_at_real_group_sizes(inter: int) -> None:
    """The embedded models' expert shapes (H=256; I=32 in v2, I=64 in v1): int8 >= 1.7x and int4 >= 3x fewer bytes than bf16."""
    kernel = SwiGLUKernel(256, inter, torch.nn.SiLU())
    bf16 = kernel.numel * 2
    int8 = GroupQuantFormat(kernel, "int8", 64, "float32").slot_bytes
    int4 = GroupQuantFormat(kernel, "int4", 64, "float32").slot_bytes
    assert bf16 / int8 >= 1.7 and bf16 / int4 >= 3.0, (bf16, int8, int4)


@pytest.mark.parametrize("kind, bound", [("int8", 0.0065), ("int4", 0.085)])
def test_round_trip_error_is_small(kind: str, bound: float) -> None:
    torch.manual_seed(0)
    w = torch.randn(128, 256)
    fmt = GroupQuantFormat(SwiGLUKernel(256, 64, torch.nn.SiLU()), kind, 64, "float32")
    (wq, _) = fmt.weights(fmt.views(fmt.encode([w, torch.randn(256, 64)])))
    rel = ((wq - w).norm() / w.norm()).item()
    assert rel < bound, rel


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int8pack_mm"),
    reason="this torch has no weight-only int8 matmul",
)
@pytest.mark.parametrize("rows", [1, 5])
def test_whole_row_int8_matmul_equals_the_dequantized_path(rows: int) -> None:
    """int8 in whole rows on bf16 runs torch's int8 matmul, not a dequantize, and gives the
    dequantized path's result to bf16 rounding (both accumulate in fp32, then round once)."""
    torch.manual_seed(0)
    H, I = 256, 64
    fmt = GroupQuantFormat(SwiGLUKernel(H, I, torch.nn.SiLU()), "int8", 0, "bfloat16")
    assert fmt._int8_rows and fmt.group_of(H) == H and fmt.group_of(I) == I
    assert fmt.slot_bytes < 2 * H * I * 3 // 1.9  # one byte a weight plus a scale per row
    views = fmt.views(fmt.encode([torch.randn(2 * I, H) * 0.05, torch.randn(H, I) * 0.05]))
    x = torch.randn(rows, H).to(torch.bfloat16)
    fast = fmt.forward(views, x)
    slow = fmt.kernel.forward(fmt.weights(views), x)
    assert fast.dtype == torch.bfloat16 and fast.shape == (rows, H)
    torch.testing.assert_close(fast.float(), slow.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(fast, torch.zeros_like(fast))
    # fp32 compute keeps the exact dequantize path (the fast kernel would round activations to bf16).
    assert not GroupQuantFormat(
        SwiGLUKernel(H, I, torch.nn.SiLU()), "int8", 0, "float32"
    )._int8_rows


def test_bad_quant_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="expert_quant must be"):
        EngineConfig(expert_quant="int3")
    with pytest.raises(ConfigError, match="expert_quant_group"):
        EngineConfig(expert_quant="int8", expert_quant_group=63)


def test_trace_records_the_quantized_expert_size(tiny_ckpt, tmp_path) -> None:
    """`moe-offload trace --expert-quant` -> the simulator charges the quantized bytes per transfer."""
    import json

    from engine.offline.trace import record_trace

    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(expert_quant="int8", quant_cache_dir=str(tmp_path))
    )
    try:
        meta = json.loads(str(record_trace(om, _prompt(om.config.vocab_size), 16)["meta"]))
        assert meta["expert_nbytes"] == om.store.slot_bytes < om.executor.fmt.kernel.numel * 4
    finally:
        om.close()
