"""The in-place KV cache (engine/worker/kv_cache.py) holds what transformers' DynamicCache holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, DynamicCache

import engine.worker.runner as runner_module
from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker import kv_cache
from engine.worker.kv_cache import InPlaceLayer, new_kv_cache
from engine.worker.loader import load_model
from engine.worker.runner import truncate_cache
from engine.worker.sampling import SamplingParams


def _rows(n: int, seed: int) -> torch.Tensor:
    """[1, 2 heads, n, 8] as attention hands them over: a transposed view of [1, n, heads, d]."""
    return torch.randn(1, n, 2, 8, generator=torch.Generator().manual_seed(seed)).transpose(1, 2)


@pytest.mark.parametrize("native_append", [True, False])
def test_appends_crops_and_growth_hold_the_same_positions_as_dynamic_cache(
    monkeypatch, tiny_ckpt, native_append: bool
) -> None:
    """With the native append (CPU) and with torch's copies (a GPU, or no compiler)."""
    monkeypatch.setattr(kv_cache, "MIN_CAPACITY", 4)  # grow often
    if not native_append:
        monkeypatch.setattr(kv_cache, "native", lambda: None)
    config = AutoConfig.from_pretrained(tiny_ckpt("qwen3_moe"))
    ours, ref = new_kv_cache(config), DynamicCache(config=config)
    assert all(type(layer) is InPlaceLayer for layer in ours.layers)
    seed = 0
    for n, crop in [(3, 0), (1, 0), (1, 0), (5, 2), (1, 0), (7, 4), (1, 0), (2, 0)]:
        for layer in range(len(ours.layers)):
            k, v = _rows(n, seed), _rows(n, seed + 1)
            seed += 2
            got, want = ours.update(k, v, layer), ref.update(k, v, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        if crop:
            length = ref.get_seq_length() - crop
            truncate_cache(ours, length), truncate_cache(ref, length)
            assert ours.get_seq_length() == ref.get_seq_length() == length
    layer = ours.layers[0]
    assert (layer._kernels is not None) is native_append  # which append ran
    assert (
        layer.keys.data_ptr() == layer._key_buffer.data_ptr()
        and layer._key_buffer.shape[-2] >= layer.keys.shape[-2]
    )


def test_an_append_with_room_writes_in_place(tiny_ckpt) -> None:
    cache = new_kv_cache(AutoConfig.from_pretrained(tiny_ckpt("qwen3_moe")))
    cache.update(_rows(5, 0), _rows(5, 1), 0)
    buffer = cache.layers[0]._key_buffer
    keys, _ = cache.update(_rows(1, 2), _rows(1, 3), 0)
    assert (
        cache.layers[0]._key_buffer is buffer and keys.data_ptr() == buffer.data_ptr()
    )  # no copy of the first 5
    assert torch.equal(keys[..., 5:, :], _rows(1, 2))


def test_a_replaced_tensor_is_adopted_on_the_next_append(tiny_ckpt) -> None:
    cache = new_kv_cache(AutoConfig.from_pretrained(tiny_ckpt("qwen3_moe")))
    cache.update(_rows(3, 0), _rows(3, 1), 0)
    layer = cache.layers[0]
    layer.keys, layer.values = (
        layer.keys.clone() * 2,
        layer.values.clone() * 2,
    )  # as reorder/select operations do
    keys, values = cache.update(_rows(1, 2), _rows(1, 3), 0)
    assert torch.equal(keys, torch.cat([_rows(3, 0) * 2, _rows(1, 2)], dim=-2))
    assert torch.equal(values, torch.cat([_rows(3, 1) * 2, _rows(1, 3)], dim=-2))


def test_attention_over_the_strided_view_is_bit_identical() -> None:
    buffer = torch.randn(1, 2, 64, 16)
    view = buffer.narrow(-2, 0, 37)
    q = torch.randn(1, 4, 1, 16)
    a = F.scaled_dot_product_attention(q, view, view, enable_gqa=True)
    b = F.scaled_dot_product_attention(q, view.contiguous(), view.contiguous(), enable_gqa=True)
    assert torch.equal(a, b)


def test_engine_decodes_past_the_first_buffer(tiny_ckpt, monkeypatch) -> None:
    """Greedy tokens with buffers that grow mid-generation equal those of transformers' own cache."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, device="cpu"))
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        monkeypatch.setattr(kv_cache, "MIN_CAPACITY", 4)
        grown = generate(om, [5, 6, 7], params).token_ids
        monkeypatch.setattr(
            runner_module, "new_kv_cache", lambda config: DynamicCache(config=config)
        )
        plain = generate(om, [5, 6, 7], params).token_ids
        assert list(grown) == list(plain) and len(grown) == 24
    finally:
        om.close()
