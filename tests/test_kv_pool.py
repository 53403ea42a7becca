"""The paged KV pool: block accounting (engine/core/kv_blocks.py) and attention through block tables
(engine/worker/kv_pool.py, cpu_gemv.h kv_row) with the bits of a contiguous buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig

from engine.core.kv_blocks import KVBlocks
from engine.native import build as native_build
from engine.native.loaded import load_build
from engine.native.variants import runnable
from engine.worker.kv_cache import InPlaceLayer
from engine.worker.kv_pool import KVPool, PagedLayer

needs_cc = pytest.mark.skipif(native_build.compiler() is None, reason="needs a C compiler")


def test_blocks_share_a_prefix_by_reference_and_free_into_an_lru_cache() -> None:
    kv = KVBlocks(6, 4)
    ids = list(range(100, 110))  # 2 whole blocks and 2 positions
    assert kv.match("a", ids) == 0 and kv.allocate("a", 10)
    kv.commit("a", ids, 10)
    assert kv.counts().in_use == 3
    # b starts with the same 8 tokens: it takes a's 2 whole blocks by reference, not a copy.
    assert kv.match("b", ids[:8] + [7, 7, 7]) == 8
    assert kv.table("b") == kv.table("a")[:2] and kv.allocate("b", 11)
    assert kv.counts().in_use == 4
    kv.free("a")  # its private third block is free; the shared two are still b's
    assert kv.counts() == kv.counts().__class__(6, 3, 0, 3)
    kv.free("b")  # b's 2 shared blocks and its third (never committed) go: cached, cached, free
    assert kv.counts().cached == 2 and kv.counts().in_use == 0
    # A new prompt that needs every block evicts the cached ones, least recently used first.
    assert kv.match("c", list(range(24))) == 0 and kv.allocate("c", 24)
    assert kv.counts().cached == 0 and kv.match("d", ids) == 0


def test_an_allocation_that_does_not_fit_takes_nothing() -> None:
    kv = KVBlocks(3, 16)
    assert kv.allocate("a", 40)
    assert not kv.allocate("b", 17) and kv.table("b") == [] and kv.available() == 0
    assert kv.needs("a", 48) == 0 and kv.needs("a", 49) == 1


def test_a_hit_stops_short_of_the_last_token_and_cancel_undoes_it() -> None:
    kv = KVBlocks(4, 4)
    ids = list(range(8))
    kv.allocate("a", 8)
    kv.commit("a", ids, 8)
    kv.free("a")
    assert kv.match("b", ids) == 4  # the last token is computed: its logits sample the first token
    kv.cancel("b")
    assert kv.hit_tokens == 0 and kv.query_tokens == 0 and kv.counts().cached == 2


def _contiguous_and_paged(
    hk: int, d: int, length: int, block: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same `length` positions as contiguous buffers [1, hk, cap, d] and as a pool [blocks, hk, block, d]
    whose table lists shuffled block ids."""
    cap = 1 << length.bit_length()
    keys, values = (torch.randn(1, hk, cap, d, generator=g).to(dtype) for _ in range(2))
    n = cap // block
    table = torch.randperm(3 * n, generator=g)[:n].contiguous()
    pool_k, pool_v = (torch.zeros(3 * n, hk, block, d, dtype=dtype) for _ in range(2))
    for i, b in enumerate(table.tolist()):
        pool_k[b] = keys[0, :, i * block : (i + 1) * block]
        pool_v[b] = values[0, :, i * block : (i + 1) * block]
    return keys, values, pool_k, pool_v, table


@needs_cc
@pytest.mark.parametrize("name", [v.name for v in runnable()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_attention_through_a_block_table_has_the_contiguous_bits(
    name: str, dtype: torch.dtype, rows: int
) -> None:
    """A decode row, a window and a prompt chunk (the key-tiled path) attend through a shuffled block
    table with the bits they get from one contiguous buffer, and write the same keys and values."""
    nk, why = load_build(name)
    assert nk is not None, why
    g = torch.Generator().manual_seed(rows)
    hq, hk, d, at, block = 8, 2, 64, 45, 16
    keys, values, pool_k, pool_v, table = _contiguous_and_paged(hk, d, at + rows, block, dtype, g)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(rows, hk, d, generator=g).to(dtype) for _ in range(2))
    angle = torch.rand(rows, d // 2, generator=g) * 3
    cos, sin = torch.cos(angle).to(dtype).contiguous(), torch.sin(angle).to(dtype).contiguous()

    def attend(key_buffer: torch.Tensor, value_buffer: torch.Tensor, **table: Any) -> torch.Tensor:
        return nk.decode_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            norms=None,
            cos=cos,
            sin=sin,
            key_buffer=key_buffer,
            value_buffer=value_buffer,
            at=at,
            scale=0.1,
            **table,
        )

    flat, paged = attend(keys, values), attend(pool_k, pool_v, table=table, block=block)
    assert torch.equal(flat, paged)
    for i, b in enumerate(table.tolist()):
        assert torch.equal(pool_k[b], keys[0, :, i * block : (i + 1) * block])
        assert torch.equal(pool_v[b], values[0, :, i * block : (i + 1) * block])


def test_the_torch_path_reads_a_paged_layer_as_a_contiguous_one() -> None:
    config = AutoConfig.for_model(
        "qwen3",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    assert KVPool.supports(config, "cpu") and not KVPool.supports(config, "meta")
    pool = KVPool(config, total=8, block=4, dtype=torch.float32)
    cache = pool.new_cache()
    KVPool.set_table(cache, (5, 2, 7))
    flat = InPlaceLayer()
    g = torch.Generator().manual_seed(0)
    for n in (3, 1, 5):  # 9 positions over 3 blocks of 4
        k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(2))
        got = cache.layers[0].update(k, v)
        want = flat.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    layer = cache.layers[0]
    assert isinstance(layer, PagedLayer) and layer.get_seq_length() == 9
    layer.crop(-2)
    assert layer.get_seq_length() == 7
    with pytest.raises(RuntimeError, match="covers 3 blocks"):
        layer.update(*(torch.zeros(1, 2, 6, 16) for _ in range(2)))
