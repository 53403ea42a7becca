"""Prompt (prefix) caching across requests: KV of completed prompt blocks, kept after a request.

Modelled on vLLM's automatic prefix caching.  A prompt is cut into fixed blocks of
`BLOCK_TOKENS` tokens; block i is keyed by a hash chain, H_i = blake2b(H_{i-1} || tokens of
block i), so a key names the whole prefix up to the block's end and equal keys mean equal
prefixes.  After each prefill chunk the runner stores the chunk's completed prompt blocks
(their keys and values, every layer, copied out of the request's cache), so a later request,
or a concurrent one admitted after the chunk ran, that starts with the same blocks skips
their prefill: `match` (at admission, by the scheduler) counts the leading blocks present and
`restore` (by the runner, before the request's first forward) writes them into the new
request's cache.  At least the prompt's last token is always computed, so the first sampled
token has its logits.

Bounded in bytes: storing past `max_bytes` evicts least recently used blocks that no running
request holds (a request holds the blocks it matched or stored until it is freed); a block
that cannot fit is not stored.  The stored numbers are those the first request computed, so a
hit gives the logits a chunked prefill starting at that block would (fp32: equal within
rounding of the matmuls' row counts, tests/test_prefix_cache.py).

Only caches made entirely of plain full-attention layers are cut into blocks (`supports`): hybrid
models (qwen3_next's linear attention keeps recurrent state, not per-position keys) and
sliding-window layers keep whole conversation snapshots instead (engine/worker/session_cache.py).  The draft model of speculative decoding keeps its own
cache and recomputes the prompt (it is small and fully resident).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.worker.kv_cache import InPlaceLayer

BLOCK_TOKENS = 16


def block_keys(ids: list[int], n_blocks: int, block: int = BLOCK_TOKENS) -> list[bytes]:
    """The hash-chain keys of the first `n_blocks` blocks of `ids`."""
    keys, prev = [], b""
    for i in range(n_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(
            torch.tensor(ids[i * block : (i + 1) * block], dtype=torch.int64).numpy().tobytes()
        )
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclass
class _Block:
    kv: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer: keys, values [1, h_kv, BLOCK_TOKENS, d]
    nbytes: int
    holders: set[str] = field(default_factory=set)  # running requests that matched or stored it


class PrefixCache:
    def __init__(self, max_bytes: int, stats: Any = None, block: int = BLOCK_TOKENS) -> None:
        self.max_bytes, self.stats, self.block = max_bytes, stats, block
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.held: dict[str, list[bytes]] = {}  # request -> keys it holds
        self.stored_upto: dict[
            str, int
        ] = {}  # request -> prompt blocks already offered to the store
        self.hit_tokens = 0  # prompt tokens served from the cache, all requests
        self.query_tokens = 0  # prompt tokens of the requests that asked

    @staticmethod
    def supports(cache: DynamicCache) -> bool:
        """Only plain full-attention layers (per-position keys and values, nothing recurrent)."""
        return bool(cache.layers) and all(
            type(layer) in (DynamicLayer, InPlaceLayer) for layer in cache.layers
        )

    # -- scheduler side (no tensors touched) --------------------------------------------
    def match(self, request_id: str, ids: list[int]) -> int:
        """Prompt tokens of `ids` already cached (whole blocks, always short of the last token);
        the matched blocks are held for `request_id` until `release`."""
        keys = block_keys(ids, (len(ids) - 1) // self.block, self.block)
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        for k in keys[:n]:
            self.blocks[k].holders.add(request_id)
            self.blocks.move_to_end(k)
        self.held[request_id] = keys[:n]
        self.stored_upto[request_id] = n
        self.hit_tokens += n * self.block
        self.query_tokens += len(ids)
        self._publish()
        return n * self.block

    # -- runner side -------------------------------------------------------------------
    def restore(self, request_id: str, cache: DynamicCache) -> int:
        """Write the blocks `request_id` matched into its (empty) cache; returns positions written."""
        keys = self.held.get(request_id, [])
        if not keys:
            return 0
        for layer in range(len(cache.layers)):
            k = torch.cat([self.blocks[key].kv[layer][0] for key in keys], dim=2)
            v = torch.cat([self.blocks[key].kv[layer][1] for key in keys], dim=2)
            cache.update(k, v, layer)
        return len(keys) * self.block

    def store(self, request_id: str, ids: list[int], cache: DynamicCache, computed: int) -> None:
        """Offer the completed prompt blocks among the first `computed` positions of `cache`."""
        done = min(computed, len(ids)) // self.block
        start = self.stored_upto.get(request_id, 0)
        if done <= start:
            return
        keys = block_keys(ids, done, self.block)
        self.stored_upto[request_id] = done
        held = self.held.setdefault(request_id, [])
        for i in range(start, done):
            key = keys[i]
            if key not in self.blocks:
                lo, hi = i * self.block, (i + 1) * self.block
                kv = [
                    (layer.keys[:, :, lo:hi].clone(), layer.values[:, :, lo:hi].clone())  # type: ignore[union-attr,index]
                    for layer in cache.layers
                ]
                nbytes = sum(t.numel() * t.element_size() for pair in kv for t in pair)
                if not self._make_room(nbytes):
                    break  # everything left is held: store nothing more for this request
                self.blocks[key] = _Block(kv, nbytes)
                self.bytes += nbytes
            self.blocks[key].holders.add(request_id)
            self.blocks.move_to_end(key)
            held.append(key)
        self._publish()

    def release(self, request_id: str, cache: object = None) -> None:
        """The request ended: its blocks become evictable (least recently used first). `cache`: its KV,
        unused here (its prompt blocks were stored as they ran; engine/worker/session_cache.py keeps it)."""
        for key in self.held.pop(request_id, []):
            b = self.blocks.get(key)
            if b is not None:
                b.holders.discard(request_id)
        self.stored_upto.pop(request_id, None)

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        if self.bytes + nbytes <= self.max_bytes:
            return True
        for key in [k for k, b in self.blocks.items() if not b.holders]:
            if self.bytes + nbytes <= self.max_bytes:
                break
            self.bytes -= self.blocks.pop(key).nbytes
        return self.bytes + nbytes <= self.max_bytes

    def _publish(self) -> None:
        if self.stats is not None:
            self.stats.set_prefix_cache(
                self.hit_tokens, self.query_tokens, self.bytes, len(self.blocks)
            )
