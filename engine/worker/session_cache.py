"""Conversation snapshots: the prompt cache for the KV caches the block prefix cache cannot hold.

Why: the paged pool (engine/core/kv_blocks.py) and the copying prefix cache (engine/worker/prefix_cache.py)
keep keys and values per position, so any whole-block prefix of a prompt can be cut out of them. A hybrid
model's linear-attention layers (qwen3_next, qwen3_5_moe: gated delta net) keep a recurrent state and a short
convolution window instead, one state valid only at the exact length it was computed to and that cannot be
cropped back; sliding-window layers keep only the window's last keys. Without this cache every turn of an
agent on such a model prefilled the whole conversation again.

What: a request's cache is snapshotted, keyed by the exact tokens its positions hold,
- when it ends (finished or aborted; not failed, not preempted): its own cache object, taken over, not copied
  (its tokens are the prompt and the outputs that were fed back, usually all but the last one; the runner
  reports each window it ran, `ran`, so the key is what was computed, whatever the finish);
- at the end of its prompt's prefill (`store`, a copy): a later turn whose re-tokenized history differs from
  the sampled tokens, or a second answer to the same history, still finds the prompt.
At admission the scheduler asks `match`: the longest snapshot whose tokens are a proper prefix of the
request's (the last token is always computed, so the first sampled token has its logits); the prefill chunks
then start after it. The snapshot is pinned until the runner's `restore` copies it into the request's new
cache in the same step, and stays: several requests can fork from one history (two sub-agents, a retried
turn), each paying one copy of the snapshot (memory bandwidth), not a prefill.

Memory: the snapshots' bytes (their tensors' storages) are bounded by `max_bytes` (--prefix-cache-bytes); the
least recently used unpinned ones are evicted first, and a snapshot larger than the budget is not kept (a
checkpoint is then not even copied). Full-attention layers are compacted to their positions when kept (the
doubling buffer's spare room of engine/worker/kv_cache.py is not held).

Exactness: a hit continues from the snapshot's state, which gives the numbers of a chunked prefill with a
chunk boundary at the snapshot's length. These models run through transformers' forward, which the plan
declares not batch-invariant; in fp32 a hit's logprobs equal a cold run's within 1e-4 and its greedy tokens
are the same (tests/test_session_cache.py).

Not covered: a fork from inside a prompt (sessions that share a system prompt but not their first message)
does not hit, as only prompt and request ends are snapshots; vLLM and SGLang checkpoint the Mamba state at
block boundaries for that.
"""

from __future__ import annotations

import copy
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.core.step_types import SeqWork
from engine.worker.kv_cache import InPlaceLayer, new_kv_cache
from engine.worker.loaded_model import LoadedModel
from engine.worker.packed_batch import NO_ROLLBACK_MODEL_TYPES
from engine.worker.prefix_cache import PrefixCache

_FULL = (DynamicLayer, InPlaceLayer)  # plain full-attention layers: keys and values per position


@dataclass
class _Snapshot:
    tokens: np.ndarray  # int64 [n]: the tokens whose positions `cache` holds, in order
    cache: DynamicCache  # frozen: nothing writes it; restore copies it
    nbytes: int
    # Requests that matched it and have not restored it yet: it is not evicted under them.
    holders: set[str] = field(default_factory=set)


@dataclass
class _Ask:
    """A request's match, held from admission to its first window (the same step)."""

    key: bytes | None  # the snapshot matched, None on a miss
    hit: int  # positions it holds
    asked: int  # the request's tokens


class SessionCache:
    """Whole-cache snapshots keyed by their exact tokens, bounded in bytes, least recently used evicted."""

    def __init__(self, max_bytes: int, stats: Any = None) -> None:
        self.max_bytes, self.stats = max_bytes, stats
        self.snapshots: OrderedDict[bytes, _Snapshot] = OrderedDict()  # least recently used first
        self.lengths: Counter[int] = Counter()  # snapshot lengths: match hashes a prompt at each
        self.bytes = 0
        self.asks: dict[
            str, _Ask
        ] = {}  # request -> its match, until restore (or release) in the same step
        self.last: dict[
            str, tuple[SeqWork, int]
        ] = {}  # request -> its last window run and positions kept
        self.hit_tokens = 0  # prompt tokens served from snapshots, all requests
        self.query_tokens = 0  # prompt tokens of the requests that asked

    # -- scheduler side (no tensors touched) --------------------------------------------
    def match(self, request_id: str, ids: list[int]) -> int:
        """Positions of `ids` a snapshot holds (the longest that is a proper prefix); it stays pinned for
        `request_id` until `restore` or `release`."""
        self.release(request_id)  # an admission asked again after it was undone
        arr = np.asarray(ids, dtype=np.int64)
        h, done, best = hashlib.blake2b(digest_size=16), 0, None
        for n in sorted(n for n in self.lengths if n < len(ids)):
            h.update(arr[done:n].tobytes())  # the hash of arr[:n], one pass over the prompt
            done = n
            snap = self.snapshots.get(key := h.copy().digest())
            if snap is not None and np.array_equal(snap.tokens, arr[:n]):
                best = key
        hit = 0
        if best is not None:
            self.snapshots[best].holders.add(request_id)
            self.snapshots.move_to_end(best)
            hit = len(self.snapshots[best].tokens)
        self.asks[request_id] = _Ask(best, hit, len(ids))
        self.hit_tokens += hit
        self.query_tokens += len(ids)
        self._publish()
        return hit

    # -- runner side -------------------------------------------------------------------
    def restore(self, request_id: str, cache: DynamicCache) -> int:
        """Copy the snapshot `request_id` matched into its new (empty) cache; returns positions restored."""
        ask = self.asks.pop(request_id, None)
        if ask is None or ask.key is None:
            return 0
        snap = self.snapshots[ask.key]
        snap.holders.discard(request_id)
        cache.layers[:] = [_thawed(layer) for layer in snap.cache.layers]
        return ask.hit

    def store(self, request_id: str, ids: list[int], cache: DynamicCache, computed: int) -> None:
        """After a prefill chunk: a checkpoint (a copy) when `cache` holds exactly the prompt `ids`."""
        if computed == len(ids):
            self._put(np.asarray(ids, dtype=np.int64), cache, owned=False)

    def ran(self, w: SeqWork, kept: int | None) -> None:
        """`w` ran and `kept` of its positions stay (None: all): what the request's cache holds now."""
        self.last[w.request_id] = (w, len(w.input_ids) if kept is None else kept)

    def release(self, request_id: str, cache: DynamicCache | None = None) -> None:
        """The request ended or its admission was undone. `cache`: its cache, to keep as a snapshot of the
        tokens it computed (None when it failed or was preempted: nothing is kept)."""
        ask = self.asks.pop(request_id, None)
        if ask is not None:  # matched, never restored: the admission did not happen
            self.hit_tokens -= ask.hit
            self.query_tokens -= ask.asked
            if ask.key is not None and ask.key in self.snapshots:
                self.snapshots[ask.key].holders.discard(request_id)
            self._publish()
        last = self.last.pop(request_id, None)
        if cache is None or last is None:
            return
        w, kept = last
        tokens = (list(w.req.prompt_ids) + list(w.output_ids))[: w.start_pos] + list(
            w.input_ids[:kept]
        )
        if tokens and _holds(cache, len(tokens)):
            self._put(np.asarray(tokens, dtype=np.int64), cache, owned=True)

    # -- the store -----------------------------------------------------------------------
    def _put(self, tokens: np.ndarray, cache: DynamicCache, owned: bool) -> None:
        key = hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()
        if key in self.snapshots:
            self.snapshots.move_to_end(key)  # the same tokens: the one kept is as good
            return
        if not self._make_room(_nbytes(cache)):
            return
        frozen = _frozen(cache, owned)
        nbytes = _nbytes(frozen)
        self.snapshots[key] = _Snapshot(tokens, frozen, nbytes)
        self.bytes += nbytes
        self.lengths[len(tokens)] += 1
        self._publish()

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        for key in [k for k, s in self.snapshots.items() if not s.holders]:
            if self.bytes + nbytes <= self.max_bytes:
                break
            snap = self.snapshots.pop(key)
            self.bytes -= snap.nbytes
            self.lengths[len(snap.tokens)] -= 1
            if not self.lengths[len(snap.tokens)]:
                del self.lengths[len(snap.tokens)]
        return self.bytes + nbytes <= self.max_bytes

    def _publish(self) -> None:
        if self.stats is not None:
            self.stats.set_prefix_cache(self.hit_tokens, self.query_tokens, self.bytes, 0)
            self.stats.set_prefix_snapshots(len(self.snapshots))


def prompt_cache_for(lm: LoadedModel) -> PrefixCache | SessionCache | None:
    """The prompt cache sized by --prefix-cache-bytes: prompt blocks where the model's cache is made of plain
    full-attention layers, conversation snapshots where it is not (hybrid, sliding-window); None when off."""
    budget = getattr(getattr(lm, "engine_config", None), "prefix_cache_bytes", 0)
    if not budget:
        return None
    stats = getattr(lm, "stats", None)
    if lm.config.model_type in NO_ROLLBACK_MODEL_TYPES or not PrefixCache.supports(
        new_kv_cache(lm.config)
    ):
        return SessionCache(budget, stats)
    return PrefixCache(budget, stats)


def _holds(cache: DynamicCache, n: int) -> bool:
    """Whether every layer that ran holds `n` positions (a check on the tokens a snapshot is keyed by)."""
    layers: list[Any] = list(cache.layers)
    return all(
        int(layer.get_seq_length()) == n
        for layer in layers
        if getattr(layer, "is_initialized", True)
    )


def _full_kv(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A plain full-attention layer's keys and values [1, heads, positions, d]; None for any other layer,
    or one that has not run."""
    if type(layer) not in _FULL or not layer.is_initialized:
        return None
    k, v = layer.keys, layer.values
    ok = isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4
    return (k, v) if ok else None


def _frozen(cache: DynamicCache, owned: bool) -> DynamicCache:
    """A snapshot of `cache`: full-attention layers as plain layers holding exactly their positions, the
    others (recurrent state, a sliding window) as they are (`owned`: nobody else will write them) or copied,
    with their keys and values cut to their own storage."""
    snap = copy.copy(cache)
    snap.layers = []
    for layer in cache.layers:
        if type(layer) in _FULL:
            plain = DynamicLayer()
            if (kv := _full_kv(layer)) is not None:
                plain.lazy_initialization(*kv)
                plain.keys, plain.values = (
                    t.clone(memory_format=torch.contiguous_format) for t in kv
                )
            snap.layers.append(plain)
            continue
        layer = layer if owned else copy.deepcopy(layer)
        for name in ("keys", "values"):  # a sliding window's keys are a view of a longer tensor
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                setattr(layer, name, t.clone(memory_format=torch.contiguous_format))
        snap.layers.append(layer)
    return snap


def _thawed(layer: Any) -> Any:
    """A request's own copy of a snapshot's layer: full attention back in a buffer that appends in place."""
    if type(layer) is DynamicLayer:
        fresh = InPlaceLayer()
        if (kv := _full_kv(layer)) is not None:
            fresh.update(*kv)
        return fresh
    return copy.deepcopy(layer)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors an object's attributes hold (directly, or in a dict, list or tuple)."""
    for value in vars(obj).values():
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        yield from (v for v in items if isinstance(v, torch.Tensor))


def _nbytes(cache: DynamicCache) -> int:
    """Bytes a snapshot of `cache` holds: full-attention layers' positions, the others' tensor storages."""
    total = 0
    for layer in cache.layers:
        if type(layer) in _FULL:
            kv = _full_kv(layer)
            total += 0 if kv is None else sum(t.numel() * t.element_size() for t in kv)
            continue
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(layer)
        }
        total += sum(storages.values())
    return total
