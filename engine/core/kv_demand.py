"""The KV blocks the requests want: what the KV/expert split (engine/memory/split.py) weighs against the pool.

Running requests hold their blocks (the pool's in-use count); each waiting request that could start next
(within --max-running) wants the blocks of its tokens so far, less the whole prefix blocks it would share
(registered blocks match() would find now). A prefix a running request is still prefilling is not
registered yet, so for a step or a few it counts again: the split then lends a little early, and its
hysteresis gives it back.

Tensor-free; the prefix lookups are remembered per request until the pool's registrations change
(KVBlocks.version), so a long shared prompt is not hashed again every step.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from engine.core.kv_blocks import KVBlocks
from engine.core.step_types import SeqState


class KvDemand:
    """`demand(blocks, running, waiting, max_running)`: blocks held plus blocks wanted, see the module docstring."""

    def __init__(self) -> None:
        self._shared: dict[
            str, tuple[int, int, int]
        ] = {}  # request -> (version, tokens, shared positions)

    def __call__(
        self, blocks: KVBlocks, running: int, waiting: Iterable[SeqState], max_running: int
    ) -> int:
        room = max(0, max_running - running)
        wanted, seen = 0, dict[str, tuple[int, int, int]]()
        for seq in islice(waiting, room):
            n = seq.fill_len
            shared = self._lookup(blocks, seq, n)
            seen[seq.request_id] = self._shared[seq.request_id]
            wanted += blocks.blocks_for(n + 1) - shared // blocks.block
        self._shared = seen  # forget the requests that started or ended
        return blocks.counts().in_use + wanted

    def _lookup(self, blocks: KVBlocks, seq: SeqState, n: int) -> int:
        memo = self._shared.get(seq.request_id)
        if memo is not None and memo[0] == blocks.version and memo[1] == n:
            return memo[2]
        shared = blocks.peek(seq.fill_ids) if seq.req.prompt_logprobs is None else 0
        self._shared[seq.request_id] = (blocks.version, n, shared)
        return shared
