"""A request's KV cache that appends in place: transformers' DynamicCache with room to grow.

Why: transformers' `DynamicLayer.update` appends a step's keys and values with `torch.cat`, which
copies the whole cache into a new tensor at every step and every layer. At one token a step that
copy is most of a decode step's attention on long contexts: on the mid peers shape (4 KV heads of
128, f32) at 2000 positions the two copies took about 1.3 ms a layer against 22 us for writing the
new row into a buffer with room (ad hoc, 1 thread). llama.cpp and vLLM preallocate their KV
cache for the same reason.

`InPlaceLayer` keeps each layer's keys and values as prefix views of a buffer whose capacity
doubles when full (at least `MIN_CAPACITY` positions), so an append is one copy of the new rows.
Everything else transformers and the engine do with a layer keeps working on the views: cropping
a rejected speculative tail (`crop` slices the view, the next append overwrites the tail),
`get_seq_length`, and the operations that replace the tensors outright (their result is adopted
as the new prefix on the next append). The values are the same numbers; attention reads them
through a strided view, bit-identical to reading a contiguous copy (tests/test_kv_cache.py).
The cost: up to twice the memory of the positions held, as any doubling buffer.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # positions a buffer starts with: a short chat never grows it


class InPlaceLayer(DynamicLayer):
    """DynamicLayer whose `keys`/`values` are [..., length, d] prefix views of [..., capacity, d] buffers."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._key_buffer, self.keys = _append(self._key_buffer, self.keys, key_states)
        self._value_buffer, self.values = _append(self._value_buffer, self.values, value_states)
        return self.keys, self.values


def _append(buffer: torch.Tensor | None, prefix: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view of its first L + n positions) after writing `rows` [..., n, d] at position L,
    where `prefix` holds the L positions so far: a view of `buffer` (written in place when it has
    room), or any other tensor (an empty one at first, or one an operation put there): copied into
    a new buffer then."""
    n = rows.shape[-2]
    length = prefix.shape[-2] if prefix.dim() == rows.dim() else 0  # lazy_initialization's prefix is a 1-d empty tensor
    if (buffer is None or length + n > buffer.shape[-2] or length == 0 or prefix.data_ptr() != buffer.data_ptr()
            or prefix.stride() != buffer.stride()):
        capacity = max(MIN_CAPACITY, 1 << (length + n - 1).bit_length())
        grown = rows.new_empty((*rows.shape[:-2], capacity, rows.shape[-1]))
        if length:
            grown.narrow(-2, 0, length).copy_(prefix)
        buffer = grown
    buffer.narrow(-2, length, n).copy_(rows)
    return buffer, buffer.narrow(-2, 0, length + n)


def new_kv_cache(config: PretrainedConfig) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers append in place; sliding-window
    layers (and any other layer type) stay transformers' own."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = InPlaceLayer()
    return cache
