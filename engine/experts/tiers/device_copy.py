"""How a fetched expert reaches its slot on a GPU: one asynchronous host-to-device copy per expert,
always from pinned (page-locked) memory, on a side stream, ordered for compute by an event.

The RAM tier's rows are pinned already (slow_tier.RamTier pins its chunks): the copy reads the row
itself. The disk tier assembles the expert straight into this worker's pinned staging row (its
`fetch(into=...)`), so that too is one copy over the link. Anything else (a RAM tier that could not
pin, a checkpoint dtype that differs from the slots') is first copied into the staging row on the
host: a copy from pageable memory would make the driver stage it in its own small pinned buffer,
synchronously, in pieces.

The CUDA calls go through `CudaOps`, so a CPU test can run this code with a recording stand-in
(tests/test_transfer_copies.py) and count the copies per expert.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

import torch

from engine.experts.tiers.slow_tier import SlowTier


class CudaOps:
    """The CUDA runtime calls a transfer makes."""

    def stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def order(self, device: torch.device, event: Any) -> None:
        """The compute stream waits for `event` on the GPU (the host does not)."""
        torch.cuda.current_stream(device).wait_event(event)


class SlotCopier:
    def __init__(self, ops: CudaOps, device: torch.device, numel: int, dtype: torch.dtype) -> None:
        self.ops, self.device, self.numel, self.dtype = ops, device, numel, dtype
        self.stream = ops.stream(device)
        self._local = threading.local()  # one pinned staging row per transfer thread

    def staging(self) -> torch.Tensor:
        row = getattr(self._local, "row", None)
        if row is None:
            row = self._local.row = self.ops.pinned(self.numel, self.dtype)
        return row

    def land(self, tier: SlowTier, layer: int, expert: int, dst: torch.Tensor) -> tuple[int, Any]:
        """Fetch the expert and copy it into slot row `dst`; returns (bytes over the link, the event
        the compute stream must wait on). Blocks this transfer thread until the copy has read its
        source (the staging row is reused by the thread's next load), never the compute stream."""
        stage = self.staging()
        host, nbytes = tier.fetch(layer, expert, into=stage)
        if host is not stage and not self.ops.is_pinned(host):
            stage.copy_(host.reshape(-1))  # pageable or another dtype: into pinned memory first
            host = stage
        with self.ops.on(self.stream):
            self.ops.copy(dst, host)
            event = self.ops.event()
            event.record(self.stream)
        event.synchronize()
        return nbytes, event

    def order(self, event: Any) -> None:
        self.ops.order(self.device, event)
