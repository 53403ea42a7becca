"""An f32 model from a bf16 checkpoint keeps its routed experts in bf16 slots (EngineConfig.bf16_expert_slots):
half the bytes in every tier, the same products, since every bf16 value widens to f32 exactly. Why it can
fail: a path that reads the slots as if they were in the compute dtype (the native kernels, the grouped
prefill GEMM, CPU-run experts, a disk read straight into a slot) computes garbage or raises; one that
rounds the activation to bf16 for the bf16 weights moves the logits by far more than f32's summation order."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_reference

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.native.loaded import native
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams

CELLS = [
    dict(cache_fraction=1.0, offload="ram"),
    dict(cache_fraction=0.5, offload="disk"),
    dict(cache_fraction=0.5, offload="ram", cpu_experts="all"),
]


def _prompt(vocab: int, n: int = 24) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def bf16_ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe", "per-expert", dtype=torch.bfloat16)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_f32_compute_from_bf16_slots_matches_transformers_f32(bf16_ckpt, cell: dict) -> None:
    ref = load_reference(bf16_ckpt)  # transformers widens the bf16 checkpoint to f32
    ids = _prompt(ref.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
        ref_tokens = ref.generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )[0, len(ids) :].tolist()
    om = load_model(bf16_ckpt, EngineConfig(dtype="float32", **cell))
    wide = load_model(bf16_ckpt, EngineConfig(dtype="float32", bf16_expert_slots=False, **cell))
    try:
        assert om.executor.store.slots.dtype == torch.bfloat16
        assert wide.executor.store.slots.dtype == torch.float32
        assert om.executor.fmt.slot_bytes * 2 == wide.executor.fmt.slot_bytes
        if native() is not None:  # decode rows take the native kernels, reading the bf16 slots
            assert om.executor.native_moe is not None
            assert om.executor.native_moe.accepts(torch.zeros(1, ref.config.hidden_size))
            # ... and the dense linears' bf16 weights (quant_linear.narrow_dense), not the embedding's
            attention = om.model.model.layers[0].self_attn
            assert om.model.lm_head.weight.dtype == attention.q_proj.weight.dtype == torch.bfloat16
            assert wide.model.lm_head.weight.dtype == torch.bfloat16  # another flag: bf16_dense
        logits = prompt_logits(om, ids)
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        assert (logits - prompt_logits(wide, ids)).abs().max().item() <= 1e-5
        for m in (om, wide):
            res = generate(m, ids, SamplingParams(max_tokens=24, ignore_eos=True))
            assert res.tokens == ref_tokens
        snap = om.stats.snapshot()
        if native() is not None and cell["cache_fraction"] == 1.0:  # one native call a decode layer
            assert snap["steps"]["decode"].get("fused", 0) >= 20, snap["steps"]
        if cell.get("cpu_experts") == "all":  # misses ran on CPU workers, from the tier's bf16 rows
            assert snap["cpu_expert_calls"] > 0
        elif cell["cache_fraction"] < 1.0:  # experts moved, at half the bytes each
            assert snap["bytes_moved"] > 0
            assert (
                om.transfers.tier.expert_nbytes(om.moe_layers[0], 0) == om.executor.fmt.slot_bytes
            )
    finally:
        om.close()
        wide.close()


def test_f32_checkpoint_keeps_f32_slots(tiny_ckpt) -> None:
    """An f32 checkpoint's experts are not bf16 values: its slots stay f32."""
    om = load_model(tiny_ckpt(), EngineConfig(dtype="float32"))
    try:
        assert om.executor.store.slots.dtype == torch.float32
    finally:
        om.close()


def test_the_dispatcher_times_the_experts_in_the_slots_dtype(bf16_ckpt, monkeypatch) -> None:
    """The native kernels' measurement (engine/native/autotune.py) times the experts as bf16 slots, the
    form the native path would read; torch's path keeps f32 slots and is timed in f32."""
    from engine.native import loaded
    from engine.native.autotune import Measurement

    if native() is None:
        pytest.skip("no C compiler: no native kernels to measure")
    seen = []

    def record(shapes, builds, ids, cache):
        seen.append(shapes)
        return Measurement({n: 1.0 for n in builds} | {"torch": 0.5}, next(iter(builds)))

    monkeypatch.setattr(loaded, "measured", record)
    om = load_model(bf16_ckpt, EngineConfig(dtype="float32"))
    om.close()
    om = load_model(bf16_ckpt, EngineConfig(dtype="float32", bf16_expert_slots=False))
    om.close()
    assert [(s.dtype, s.expert_dtype) for s in seen] == [("float32", "bfloat16"), ("float32", "")]


def test_dense_weights_widen_where_asked_and_stay_exact(bf16_ckpt) -> None:
    """--no-bf16-dense: the dense linears in f32, as before; the same greedy tokens and logits within
    f32's summation order of the bf16-weight run."""
    om = load_model(bf16_ckpt, EngineConfig(dtype="float32"))
    wide = load_model(bf16_ckpt, EngineConfig(dtype="float32", bf16_dense=False))
    ids = _prompt(om.model.config.vocab_size)
    try:
        assert wide.model.lm_head.weight.dtype == torch.float32
        assert (prompt_logits(om, ids) - prompt_logits(wide, ids)).abs().max().item() <= 1e-5
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        assert generate(om, ids, params).tokens == generate(wide, ids, params).tokens
    finally:
        om.close()
        wide.close()


def test_a_head_tied_to_the_embedding_keeps_its_f32_weight(tiny_ckpt) -> None:
    """The embedding reads the same Parameter as a tied head: narrowing it would hand the f32 model bf16
    embeddings, so it stays f32, and the model still matches transformers."""
    path = tiny_ckpt("qwen3_moe", "per-expert", dtype=torch.bfloat16, tie_word_embeddings=True)
    ref = load_reference(path)
    ids = _prompt(ref.config.vocab_size)
    om = load_model(path, EngineConfig(dtype="float32"))
    try:
        head = om.model.lm_head.weight
        assert head is om.model.get_input_embeddings().weight and head.dtype == torch.float32
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert (prompt_logits(om, ids) - want).abs().max().item() <= 1e-4
    finally:
        om.close()
