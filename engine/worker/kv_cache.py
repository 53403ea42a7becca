"""A request's KV cache that appends in place: transformers' DynamicCache with room to grow.

Why: transformers' `DynamicLayer.update` appends a step's keys and values with `torch.cat`, which
copies the whole cache into a new tensor at every step and every layer. At one token a step that
copy is most of a decode step's attention on long contexts: with 4 KV heads of 128 in f32 at 2000
positions the two copies took about 1.3 ms a layer against 22 us for writing the
new row into a buffer with room (ad hoc, 1 thread). llama.cpp and vLLM preallocate their KV
cache for the same reason.

`InPlaceLayer` keeps each layer's keys and values as prefix views of a buffer whose capacity
doubles when full (at least `MIN_CAPACITY` positions), so an append is one copy of the new rows
(on the CPU one native call writes both keys and values: on short contexts the dispatch of
separate copies cost more than the `torch.cat`s they replace).
Everything else transformers and the engine do with a layer keeps working on the views: cropping
a rejected speculative tail (`crop` slices the view, the next append overwrites the tail),
`get_seq_length`, and the operations that replace the tensors outright (their result is adopted
as the new prefix on the next append). The values are the same numbers; attention reads them
through a strided view, bit-identical to reading a contiguous copy (tests/test_kv_cache.py).
The cost: up to twice the memory of the positions held, as any doubling buffer.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from engine.native.kernels import NativeKernels
from engine.native.loaded import native

MIN_CAPACITY = 256  # positions a buffer starts with: a short chat never grows it


class InPlaceLayer(DynamicLayer):
    """DynamicLayer whose `keys`/`values` are [1, heads, length, d] prefix views of [1, heads, capacity, d] buffers."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    _kernels: NativeKernels | None = None  # where appends run natively: CPU buffers of one sequence
    # The (keys, values) views advance() last made, and their length: while the layer still holds those
    # very tensors (nothing cropped or replaced them), reserve() skips re-checking they view the buffers.
    _views: tuple[torch.Tensor, torch.Tensor] | None = None
    _length: int = 0
    # The native kernels' view of the buffers (cpu_gemv.h kv_row): one block holding every position.
    block_table: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return 0 if self._key_buffer is None else self._key_buffer.shape[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb, length = self.reserve(key_states, value_states)
        n = key_states.shape[-2]
        kernels = self._kernels
        if (
            kernels is not None
            and key_states.dtype == value_states.dtype == kb.dtype
            and key_states.stride(3) == 1
            and value_states.stride(3) == 1
            and key_states.shape == value_states.shape
        ):
            kernels.kv_append(
                kb, vb, key_states, value_states, length
            )  # both writes in one native call
        else:
            kb.narrow(2, length, n).copy_(key_states)
            vb.narrow(2, length, n).copy_(value_states)
        return self.advance(length + n)

    def reserve(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(key buffer, value buffer, length L) with room for these [1, heads, n, d] rows at L..L+n-1,
        which the caller writes before advance(L + n). Buffers are made or grown here, holding the
        L positions so far."""
        kb, vb, keys, values, views = (
            self._key_buffer,
            self._value_buffer,
            self.keys,
            self.values,
            self._views,
        )
        if (
            views is not None
            and keys is views[0]
            and values is views[1]
            and kb is not None
            and vb is not None
            and self._length + key_states.shape[-2] <= kb.shape[2]
        ):
            return kb, vb, self._length  # the views advance() made, with room: nothing to check
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            keys, values = self.keys, self.values
        assert keys is not None and values is not None  # lazy_initialization set them
        n = key_states.shape[-2]
        length = (
            keys.shape[-2] if keys.dim() == 4 else 0
        )  # lazy_initialization's prefix is a 1-d empty tensor
        if (
            kb is None
            or vb is None
            or not length
            or length + n > kb.shape[2]
            or keys.data_ptr() != kb.data_ptr()
            or values.data_ptr() != vb.data_ptr()
            or keys.stride() != kb.stride()
            or values.stride() != vb.stride()
        ):
            # First append, full, or the prefix is not (or no longer) a view of the buffers: new ones.
            kb, vb = _grown(keys, key_states, length), _grown(values, value_states, length)
            self._key_buffer, self._value_buffer = kb, vb
            self._kernels = native() if kb.device.type == "cpu" and kb.shape[0] == 1 else None
        return kb, vb, length

    def advance(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of the buffers are the cache now: (keys, values) views of them."""
        kb, vb = self._key_buffer, self._value_buffer
        assert kb is not None and vb is not None  # reserve() made them
        keys, values = kb.narrow(2, 0, length), vb.narrow(2, 0, length)
        self.keys, self.values, self._views, self._length = keys, values, (keys, values), length
        return keys, values


def _grown(prefix: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """A new buffer [1, heads, capacity, d] for `length` + n positions (at least MIN_CAPACITY, a power
    of two), holding the `length` positions of `prefix`."""
    capacity = max(MIN_CAPACITY, 1 << (length + rows.shape[2] - 1).bit_length())
    buffer = rows.new_empty((*rows.shape[:2], capacity, rows.shape[3]))
    if length:
        buffer.narrow(2, 0, length).copy_(prefix)
    return buffer


def new_kv_cache(config: PretrainedConfig) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers append in place; sliding-window
    layers (and any other layer type) stay transformers' own."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = InPlaceLayer()
    return cache


class _CroppableLayer(Protocol):
    """A KV layer with positions to crop: what rollback-capable models' caches hold (no linear attention)."""

    def get_seq_length(self) -> int: ...

    def crop(self, tokens_to_remove: int) -> None: ...


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Crop every layer of a KV cache back to `length` positions (layers may differ after a
    forward that failed midway: the ones it reached hold the window, the others do not)."""
    for layer in cast("list[_CroppableLayer]", cache.layers):
        if getattr(layer, "is_initialized", False):
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
