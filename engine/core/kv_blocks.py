"""The KV pool's blocks as the scheduler sees them: who holds which block, which blocks hold a cached
prefix, how many are free. No tensors: a block id is an index into the pool's storage
(engine/worker/kv_pool.py), which the runner addresses through each request's block table.

Modelled on vLLM v1's block pool with automatic prefix caching (and SGLang's radix cache, flattened
to a hash chain):

- A request's table lists its blocks in position order, `block` positions each; it grows as the
  request's positions do (`allocate`) and is given back whole (`free`).
- Once every position of a block is computed, the block is registered under the hash of all the
  tokens up to its end (`commit`: a chain, H_i = blake2b(H_{i-1} || tokens of block i), so equal
  hashes mean equal prefixes). A later request whose tokens start the same way takes those blocks by
  reference at admission (`match`): KV memory is the distinct positions, not the sum of sessions.
- A registered block that nobody references stays cached, least recently used first, until its
  space is needed: a finished session's history, or a preempted request's, is there when it returns.
- Only whole computed blocks are shared, and a request writes only past the positions it matched
  (a hit always stops short of the last prompt token), so a shared block is never written: no
  copy-on-write is needed. Registered blocks are final: positions below a request's computed count
  never change (a speculative rollback only drops positions above it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

BLOCK_TOKENS = 16  # positions a block: vLLM's default; the native kernels need a power of two


def pool_blocks(kv_token_budget: int, one_context: int, block: int = BLOCK_TOKENS) -> int:
    """The pool's blocks: the positions the memory plan reserved, and never fewer than one request at the whole
    context (and its lookahead), so a request alone always fits: no context cap below the model's."""
    return max(-(-kv_token_budget // block), -(-one_context // block))


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block of `tokens` after the prefix whose hash is `prev`."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass
class _Holder:
    """One request's blocks and how far its tokens are hashed."""

    table: list[int] = field(default_factory=list)
    hashed: int = (
        0  # leading blocks of `table` whose hash is known (registered, or found registered)
    )
    last_hash: bytes = b""  # the chain's hash after `hashed` blocks
    asked: int = 0  # positions match() was asked about, and found (for the hit rate)
    found: int = 0


@dataclass(frozen=True)
class BlockCounts:
    """A snapshot for metrics and the plan line."""

    total: int
    in_use: int  # referenced by at least one request
    cached: int  # unreferenced, holding a registered prefix (reusable, evictable)
    free: int  # neither

    @property
    def available(self) -> int:
        return self.cached + self.free


class KVBlocks:
    """The block accounting of one KV pool of `total` blocks of `block` positions."""

    def __init__(self, total: int, block: int = BLOCK_TOKENS, cache_prefixes: bool = True) -> None:
        if total < 1 or block < 1 or block & (block - 1):
            raise ValueError("a KV pool needs at least one block and a power-of-two block size")
        self.total, self.block, self.cache_prefixes = total, block, cache_prefixes
        self._free: list[int] = list(range(total - 1, -1, -1))  # pop() takes the lowest id first
        self._refs = [0] * total
        self._hash_of: dict[int, bytes] = {}  # registered block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> registered block
        self._cached: OrderedDict[int, None] = (
            OrderedDict()
        )  # unreferenced registered blocks, LRU first
        self._holders: dict[str, _Holder] = {}
        self.version = (
            0  # moves whenever a prefix is registered or evicted: what peek() finds may change
        )
        self.hit_tokens = 0  # prompt positions served by matched blocks, all requests
        self.query_tokens = 0  # prompt positions of the requests that asked

    # -- questions -----------------------------------------------------------------------------
    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block)

    def table(self, request_id: str) -> list[int]:
        holder = self._holders.get(request_id)
        return holder.table if holder is not None else []

    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones (evicted as needed)."""
        return len(self._free) + len(self._cached)

    def peek(self, ids: Sequence[int]) -> int:
        """The positions match() would find for `ids` now (whole registered blocks), taking nothing."""
        if not self.cache_prefixes:
            return 0
        prev, found = b"", 0
        for i in range((len(ids) - 1) // self.block):
            prev = chain_hash(prev, ids[i * self.block : (i + 1) * self.block])
            if prev not in self._block_of:
                break
            found += self.block
        return found

    def needs(self, request_id: str, positions: int) -> int:
        """New blocks `request_id` needs to cover `positions` positions."""
        return max(0, self.blocks_for(positions) - len(self.table(request_id)))

    def counts(self) -> BlockCounts:
        cached, free = len(self._cached), len(self._free)
        return BlockCounts(self.total, self.total - cached - free, cached, free)

    # -- changes -------------------------------------------------------------------------------
    def match(self, request_id: str, ids: Sequence[int]) -> int:
        """At admission: take the registered blocks that start `ids` (whole blocks, always short of
        the last token, so the first sampled token has its logits) into `request_id`'s new table;
        returns the positions they hold."""
        holder = self._holders.setdefault(request_id, _Holder())
        assert not holder.table, "match() is for a request that holds no blocks"
        self.query_tokens += len(ids)
        holder.asked = len(ids)
        if not self.cache_prefixes:
            return 0  # found stays 0
        prev = b""
        for i in range((len(ids) - 1) // self.block):
            h = chain_hash(prev, ids[i * self.block : (i + 1) * self.block])
            b = self._block_of.get(h)
            if b is None:
                break
            self._ref(b)
            holder.table.append(b)
            prev = h
        holder.hashed, holder.last_hash = len(holder.table), prev
        holder.found = len(holder.table) * self.block
        self.hit_tokens += holder.found
        return holder.found

    def cancel(self, request_id: str) -> None:
        """Undo an admission that did not happen: free's effect, and its match leaves the hit rate."""
        holder = self._holders.get(request_id)
        if holder is not None:
            self.query_tokens -= holder.asked
            self.hit_tokens -= holder.found
        self.free(request_id)

    def allocate(self, request_id: str, positions: int) -> bool:
        """Grow `request_id`'s table to cover `positions` positions; False (and nothing taken) when
        the pool has too few blocks left."""
        holder = self._holders.setdefault(request_id, _Holder())
        need = self.blocks_for(positions) - len(holder.table)
        if need <= 0:
            return True
        if need > self.available():
            return False
        for _ in range(need):
            b = self._free.pop() if self._free else self._evict_cached()
            self._refs[b] = 1
            holder.table.append(b)
        return True

    def uncommitted(self, request_id: str, computed: int) -> int:
        """Whole blocks among `request_id`'s first `computed` positions that commit() has not registered yet:
        the caller builds the tokens commit() reads only when there are some."""
        holder = self._holders.get(request_id)
        if holder is None or not self.cache_prefixes:
            return 0
        return max(0, min(computed, len(holder.table) * self.block) // self.block - holder.hashed)

    def commit(self, request_id: str, ids: Sequence[int], computed: int) -> None:
        """Register `request_id`'s whole blocks among its first `computed` positions, whose tokens
        are ids[:computed]. A prefix some other block already holds keeps that block (this request's
        copy stays private)."""
        new = self.uncommitted(request_id, computed)
        if new <= 0:
            return
        holder = self._holders[request_id]
        end = min(
            holder.hashed + new, len(ids) // self.block
        )  # only blocks whose tokens are all in ids
        for i in range(holder.hashed, end):
            h = chain_hash(holder.last_hash, ids[i * self.block : (i + 1) * self.block])
            b = holder.table[i]
            if h not in self._block_of and b not in self._hash_of:
                self._block_of[h], self._hash_of[b] = b, h
                self.version += 1
            holder.last_hash = h
        holder.hashed = max(holder.hashed, end)

    def free(self, request_id: str) -> None:
        """The request ended or was preempted: its references go; registered blocks stay cached
        (most recently used last), the others are free."""
        holder = self._holders.pop(request_id, None)
        if holder is None:
            return
        for b in reversed(holder.table):  # a prefix's tail blocks are evicted before its head
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None  # after the older cached blocks; its own tail first
                else:
                    self._free.append(b)

    def resize(self, total: int) -> int:
        """Grow or shrink the pool to `total` blocks (the KV/expert split, engine/memory/split.py); returns the
        size it has now. New blocks are the highest ids, taken after the lower free ones. Shrinking drops the
        blocks from `total` up, evicting the cached prefixes among them, and stops above the highest one a
        request holds (so it may shrink less than asked). The storage is the caller's (it may release the pages)."""
        if total >= self.total:
            self._refs += [0] * (total - self.total)
            self._free[:0] = range(
                total - 1, self.total - 1, -1
            )  # pop() takes the end: these come last
        else:
            held = [b for b in range(total, self.total) if self._refs[b] > 0]
            total = max(total, held[-1] + 1) if held else max(total, 1)
            for b in range(total, self.total):
                if b in self._cached:
                    del self._cached[b]
                    del self._block_of[self._hash_of.pop(b)]
                    self.version += 1
            self._free = [b for b in self._free if b < total]
            del self._refs[total:]
        self.total = total
        return total

    def relocate(self, limit: int) -> list[tuple[int, int]]:
        """Before a shrink to `limit` blocks: move the cached prefixes at or above it into free blocks below
        it, most recently used first, so the prefix cache outlives the shrink where there is room. Returns
        the (from, to) pairs whose contents the caller copies before anything reads them."""
        below = [b for b in self._free if b < limit]
        moved: dict[int, int] = {}
        for src in reversed(self._cached):  # most recently used first
            if not below:
                break
            if src >= limit:
                moved[src] = below.pop()
        if not moved:
            return []
        for src, dst in moved.items():
            h = self._hash_of.pop(src)
            self._hash_of[dst], self._block_of[h] = h, dst
        self._cached = OrderedDict((moved.get(b, b), None) for b in self._cached)  # same LRU order
        taken = set(moved.values())
        self._free = [b for b in self._free if b not in taken] + list(moved)
        return list(moved.items())

    def _ref(self, b: int) -> None:
        if self._refs[b] == 0:
            self._cached.pop(b, None)
        self._refs[b] += 1

    def _evict_cached(self) -> int:
        b, _ = self._cached.popitem(last=False)
        del self._block_of[self._hash_of.pop(b)]
        self.version += 1
        return b
