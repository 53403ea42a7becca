"""One paged KV pool for every request: keys and values in fixed blocks, read through block tables.

Why: a request that owns its KV buffer (engine/worker/kv_cache.py) holds up to twice its positions,
and sessions that share a long system prompt each hold a copy of it. Here each layer's keys and
values are one buffer [blocks, kv heads, BLOCK, head dim]; a request's positions live in the blocks
its table lists, in order (the scheduler's engine/core/kv_blocks.py decides which, and shares whole
prefix blocks by reference), so KV memory is the distinct positions. vLLM's PagedAttention.

The native attention reads and writes through the table (cpu_gemv.h `kv_row`) with the same
arithmetic in the same key order as a contiguous buffer: the bits do not depend on where the blocks
are (tests/test_kv_pool.py). The torch path (no native kernels) gets each layer's positions
gathered into one tensor, the numbers a contiguous cache holds.

Pages: the buffers are made with torch.empty, so the OS backs a block with memory when it is first
written; the scheduler hands out the lowest free ids first, so the touched part of the pool follows
the peak of positions in use, not the pool's size.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from engine.budget import fmt_bytes
from engine.huge_pages import release_pages
from engine.memory.split import MemorySplit, memory_split_for
from engine.native.loaded import active, native
from engine.worker.kv_cache import InPlaceLayer, new_kv_cache


@dataclass
class _Table:
    """A request's block table, shared by its layers; the runner sets it before each step."""

    ids: torch.Tensor


class PagedLayer(DynamicLayer):
    """A layer of a request's KV cache in the pool: its keys and values are the pool's buffers for
    this layer, addressed through the request's block table."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, table: _Table) -> None:
        super().__init__()
        self._key_buffer, self._value_buffer, self._table = keys, values, table
        self._length = 0
        self.is_initialized = True
        self.device = keys.device

    @property
    def block_table(self) -> torch.Tensor:
        return self._table.ids

    @property
    def block_size(self) -> int:
        return self._key_buffer.shape[2]

    def reserve(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(key buffer, value buffer, length L): these [1, heads, n, d] rows go to positions L..L+n-1,
        which the caller writes (through the table) before advance(L + n)."""
        end = self._length + key_states.shape[-2]
        if end > self._table.ids.numel() * self.block_size:  # the scheduler allocates first: a bug
            raise RuntimeError(
                f"KV block table covers {self._table.ids.numel()} blocks, not {end} positions"
            )
        if key_states.dtype != self._key_buffer.dtype:
            raise RuntimeError(f"KV pool in {self._key_buffer.dtype} for {key_states.dtype} rows")
        return self._key_buffer, self._value_buffer, self._length

    def advance(self, length: int) -> None:
        self._length = length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: write the rows, return every position's keys and values [1, heads, L, d]."""
        kb, vb, length = self.reserve(key_states, value_states)
        n, bs = key_states.shape[-2], self.block_size
        pos = torch.arange(length, length + n)
        blocks, offsets = self._table.ids[pos // bs], pos % bs
        kb[blocks, :, offsets] = key_states[0].transpose(0, 1).to(kb.device)
        vb[blocks, :, offsets] = value_states[0].transpose(0, 1).to(vb.device)
        self._length = length + n
        return self._gathered(kb), self._gathered(vb)

    def _gathered(self, buffer: torch.Tensor) -> torch.Tensor:
        nb = -(-self._length // self.block_size)
        blocks = buffer[self._table.ids[:nb]]  # [nb, heads, bs, d]
        heads, d = buffer.shape[1], buffer.shape[3]
        flat = blocks.transpose(0, 1).reshape(heads, nb * self.block_size, d)
        return flat[:, : self._length].unsqueeze(0)

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self._length = max(0, self._length + tokens_to_remove)


# The cache layers the native attention appends to and reads in place.
NATIVE_KV_LAYERS = (InPlaceLayer, PagedLayer)


class KVPool:
    """The pool's storage: per layer, keys and values [blocks, kv heads, block, head dim]."""

    def __init__(
        self, config: PretrainedConfig, total: int, block: int, dtype: torch.dtype
    ) -> None:
        layers, heads, d = _geometry(config)
        self.config, self.total, self.block = config, total, block
        shape = (total, heads, block, d)
        self.keys = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.bytes_per_block = self.block_bytes(config, block, dtype)
        self.split: MemorySplit | None = (
            None  # the KV/expert split that may grow and shrink its use
        )

    @staticmethod
    def block_bytes(config: PretrainedConfig, block: int, dtype: torch.dtype) -> int:
        """Bytes of one block, every layer's keys and values."""
        layers, heads, d = _geometry(config)
        return 2 * layers * heads * block * d * torch.finfo(dtype).bits // 8

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (from, to) block's keys and values, every layer (a cached prefix moved before a shrink)."""
        if pairs:
            src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
            for buf in self.keys + self.values:
                buf[dst] = buf[src]

    def release(self, first: int, last: int) -> int:
        """Give the OS back the pages of blocks first..last-1, which no request holds (the memory split
        shrank the pool); returns the bytes. The next write to such a block faults a fresh page in."""
        return sum(release_pages(buf[first:last]) for buf in self.keys + self.values)

    @staticmethod
    def supports(config: PretrainedConfig, device: torch.device | str) -> bool:
        """On the CPU, for caches made only of plain full-attention layers (no recurrent state, no
        sliding window: their positions are not blocks of one table) whose keys and values are
        [kv heads, head dim] a position (not multi-head latent attention's, whose keys and values
        differ in size)."""
        cache = new_kv_cache(config)
        return (
            torch.device(device).type == "cpu"
            and getattr(config.get_text_config(), "kv_lora_rank", None) is None
            and bool(cache.layers)
            and all(type(layer) is InPlaceLayer for layer in cache.layers)
        )

    def new_cache(self, shared: int = 0) -> DynamicCache:
        """A cache for one request, its layers in this pool, sharing one table (set_table), holding its
        first `shared` positions already: the prefix blocks the scheduler matched."""
        cache = new_kv_cache(self.config)
        table = _Table(torch.zeros(0, dtype=torch.int64))
        layers = [PagedLayer(k, v, table) for k, v in zip(self.keys, self.values, strict=True)]
        for layer in layers:
            layer.advance(shared)
        cache.layers = list(layers)
        return cache

    @staticmethod
    def set_table(cache: DynamicCache, table: tuple[int, ...]) -> None:
        """The blocks the scheduler gave the request for this step (its table only grows while it runs)."""
        layer = cache.layers[0]
        assert isinstance(layer, PagedLayer)
        if layer.block_table.numel() != len(table):
            layer._table.ids = torch.tensor(table, dtype=torch.int64)


def _geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model's KV cache."""
    text = config.get_text_config()
    heads = text.num_key_value_heads or text.num_attention_heads
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return len(new_kv_cache(config).layers), heads, d


def paged_pool_for(lm: Any, lean: bool, total: int, block: int) -> KVPool | None:
    """A pool of `total` blocks for a loaded model whose every row attends natively (the lean forward,
    native kernels, native attention; else the torch path would gather the blocks every step, and each
    request keeps its own buffer), with a start-up line beside the memory plan's table; None where not.
    Its tensors have room for the blocks the memory split may borrow from the experts (`pool.split`,
    engine/memory/split.py); untouched, they cost nothing."""
    plan = getattr(lm, "plan", None)
    with active(lm.native):
        native_rows = native() is not None and (plan is None or plan.native_attention)
    if not (native_rows and lean and KVPool.supports(lm.config, lm.device)):
        return None
    split = memory_split_for(lm, total, KVPool.block_bytes(lm.config, block, lm.model.dtype))
    pool = KVPool(lm.config, split.max_blocks() if split else total, block, lm.model.dtype)
    pool.split = split
    if split is not None:
        split.pool = pool
    print(
        f"KV pool: {total} blocks of {block} positions, {fmt_bytes(total * pool.bytes_per_block)} "
        f"({lm.model.dtype}); requests share whole prefix blocks; pages are touched as blocks are used"
        + (f"\n{split.line()}" if split is not None else ""),
        file=sys.stderr,
        flush=True,
    )
    return pool
