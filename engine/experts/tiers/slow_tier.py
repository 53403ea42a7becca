"""The slow tier: where every routed expert lives. Host RAM, or the checkpoint on disk.

`fetch(layer, expert)` returns the expert's packed buffer as a flat host tensor (see
expert_layout). The transfer engine then copies it into a fast-tier slot.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.experts.tiers.link import EmulatedLink
from engine.experts.tiers.read_faults import ReadFaults
from engine.experts.tiers.uncached_io import UncachedReader
from engine.huge_pages import empty
from engine.weights.checkpoint import read_tensor, torch_dtype
from engine.weights.expert_layout import SegmentLocator
from engine.weights.safetensors_index import TensorLocation

# Named as before the move into tiers/ (issue 52): the engine's log lines print the logger's name.
log = logging.getLogger("engine.experts.slow_tier")


class SlowTier(ABC):
    name: str

    def __init__(self, locator: SegmentLocator, link: EmulatedLink | None) -> None:
        self.locator = locator
        self.link = link
        self.faults: ReadFaults | None = None  # injected read faults (set_faults), off by default

    def set_faults(self, faults: ReadFaults | None) -> None:
        """Route every fetch through `faults` (engine/experts/tiers/read_faults.py): --expert-read-faults."""
        self.faults = faults

    def fetch(
        self, layer: int, expert: int, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """Return (flat host tensor, bytes that crossed the link). Honours the emulated link.

        `into`: the host slot the expert is headed for. A tier may assemble the expert there and
        return `into` itself, which saves the caller's copy (the disk tier does when the dtypes
        match); else it returns its own buffer, as without `into`."""
        nbytes = self.expert_nbytes(layer, expert)
        deadline = self.link.reserve(nbytes) if self.link else None
        if self.faults is None:
            buf = self._fetch(layer, expert, into)
        else:
            try:
                self.faults.before_fetch(layer, expert)
                buf = self._fetch(layer, expert, into)
            finally:
                self.faults.after_fetch()
        if deadline is not None:
            EmulatedLink.wait_until(deadline)
        return buf, nbytes

    @abstractmethod
    def expert_nbytes(self, layer: int, expert: int) -> int: ...

    @abstractmethod
    def _fetch(self, layer: int, expert: int, into: torch.Tensor | None) -> torch.Tensor: ...

    def close(self) -> None:  # noqa: B027 (optional hook: tiers without resources keep the no-op)
        pass


PIN_CHUNK_BYTES = 1 << 30  # page-locked memory is allocated at most this much at a time
PIN_SHARE = 0.5  # ... and never more than this share of the machine's RAM in all


class RamTier(SlowTier):
    """All experts packed in host RAM (pinned when CUDA is present, so copies are async).

    Page-locking tens of GB in one allocation fails on many systems, and locked pages cannot be
    reclaimed, so a pinned tier is allocated in chunks of at most `chunk_bytes`, and at most
    PIN_SHARE of the machine's RAM is locked. Where a chunk cannot be pinned (no driver, the
    allocation refused, the share reached) it and the rest are ordinary pageable memory: slower
    copies, never a crash. That is said once in the log and counted (`pageable_bytes`)."""

    name = "ram"

    def __init__(
        self,
        locator: SegmentLocator,
        layers: list[int],
        dtype: torch.dtype,
        pin: bool,
        link: EmulatedLink | None = None,
        chunk_bytes: int = PIN_CHUNK_BYTES,
        pin_limit: int | None = None,
        huge_pages: bool = False,
    ) -> None:
        super().__init__(locator, link)
        n, E = len(layers), locator.num_experts
        self._row = {layer: i for i, layer in enumerate(layers)}
        rows, numel = n * E, locator.shape.numel
        row_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.pageable_bytes = 0  # bytes of a tier meant to be pinned that are pageable
        self.pin_error: str | None = None
        if not pin:
            self._chunks = [empty((rows, numel), dtype, huge_pages)]
        else:
            per = max(1, chunk_bytes // row_bytes)
            budget = _pin_limit() if pin_limit is None else pin_limit
            self._chunks = []
            for start in range(0, rows, per):
                count = min(per, rows - start)
                self._chunks.append(self._alloc(count, numel, dtype, budget))
                budget -= count * row_bytes if self.pin_error is None else 0
        self._per = self._chunks[0].shape[0] if self._chunks else 1
        with tqdm(total=rows, desc="loading experts to RAM", unit="expert", leave=False) as bar:
            for layer in layers:
                for e in range(E):
                    i = self._row[layer] * E + e
                    self._chunks[i // self._per][i % self._per] = _pack(
                        [read_tensor(s) for s in locator.segments(layer, e)]
                    )
                    bar.update()

    def _alloc(self, count: int, numel: int, dtype: torch.dtype, budget: int) -> torch.Tensor:
        nbytes = count * numel * torch.empty((), dtype=dtype).element_size()
        if self.pin_error is None and nbytes > budget:
            self.pin_error = f"pinning more would lock over {PIN_SHARE:.0%} of the machine's RAM"
        if self.pin_error is None:
            try:
                return torch.empty((count, numel), dtype=dtype, pin_memory=True)
            except (RuntimeError, MemoryError) as e:  # no CUDA driver, or the allocation refused
                self.pin_error = str(e).splitlines()[0] if str(e) else type(e).__name__
        if self.pageable_bytes == 0:
            log.warning(
                "host expert tier: pinning failed (%s); the rest of it (%d experts and on) is pageable memory, "
                "so copies to the device are slower and synchronous",
                self.pin_error,
                sum(c.shape[0] for c in self._chunks),
            )
        self.pageable_bytes += nbytes
        return torch.empty((count, numel), dtype=dtype)

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._chunks)

    @property
    def buffer(self) -> torch.Tensor:
        """[layers * experts, numel]: every expert, one row each (the fast tier's pool when zero-copy;
        only an unpinned tier, which is one allocation)."""
        assert len(self._chunks) == 1, "a chunked (pinned) tier has no single buffer"
        return self._chunks[0]

    def row(self, layer: int, expert: int) -> int:
        return self._row[layer] * self.locator.num_experts + expert

    def expert_nbytes(self, layer: int, expert: int) -> int:
        c = self._chunks[0]
        return c.shape[1] * c.element_size()

    def _fetch(self, layer: int, expert: int, into: torch.Tensor | None) -> torch.Tensor:
        i = self.row(layer, expert)
        return self._chunks[i // self._per][
            i % self._per
        ]  # a view: the caller's copy is the only one


def _pin_limit() -> int:
    """PIN_SHARE of the machine's physical RAM, in bytes."""
    try:
        return int(PIN_SHARE * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class DiskTier(SlowTier):
    """Reads experts from the checkpoint files on every fetch, bypassing the page cache."""

    name = "disk"

    def __init__(
        self, locator: SegmentLocator, link: EmulatedLink | None = None, prefer_direct: bool = True
    ) -> None:
        super().__init__(locator, link)
        self.reader = UncachedReader(prefer_direct)

    def set_faults(self, faults: ReadFaults | None) -> None:
        super().set_faults(faults)
        self.reader.faults = faults  # a `short` fault cuts the reader's next pread

    def expert_nbytes(self, layer: int, expert: int) -> int:
        return self.locator.nbytes_on_disk(layer, expert)

    def _fetch(self, layer: int, expert: int, into: torch.Tensor | None) -> torch.Tensor:
        segs = self.locator.segments(layer, expert)
        span = _one_span(segs)
        if span is not None:
            # The expert's tensors lie side by side in one file (safetensors stores an expert's
            # down/gate/up next to each other): one read instead of one per tensor. Each read
            # is a syscall, an aligned buffer and, with O_DIRECT, a device round trip, all on a
            # transfer thread that shares the machine's cores with the compute thread.
            start, end = span
            raw = self.reader.read(
                segs[0].path, start, end - start, scratch=True
            )  # _pack copies it at once
            return _pack(
                [
                    torch.frombuffer(
                        raw[s.offset - start : s.offset - start + s.nbytes],
                        dtype=torch_dtype(s.dtype),
                    )
                    for s in segs
                ],
                into,
            )
        if len({s.dtype for s in segs}) == 1:
            return self._read_apart(segs, into)
        return _pack([self._read(s) for s in segs], into)

    def _read_apart(self, segs: list[TensorLocation], into: torch.Tensor | None) -> torch.Tensor:
        """Tensors of one dtype far apart in their files (gpt-oss keeps a layer's experts in one tensor
        per part): one read per tensor, each into the thread's reusable buffer and copied at once to its
        place in the slot (`into` where it fits, else a new buffer), so no read pays for a fresh buffer."""
        dtype, total = torch_dtype(segs[0].dtype), sum(s.nbytes for s in segs)
        fits = (
            into is not None
            and into.device.type == "cpu"
            and into.dtype == dtype
            and into.is_contiguous()
            and into.numel() * into.element_size() == total
        )
        out = (
            into if fits and into is not None else torch.empty(total, dtype=torch.uint8).view(dtype)
        )
        dst = out.view(-1).view(torch.uint8).numpy()
        at = 0
        for s in segs:
            raw = self.reader.read(s.path, s.offset, s.nbytes, scratch=True)  # copied at once
            dst[at : at + s.nbytes] = np.frombuffer(raw, dtype=np.uint8)
            at += s.nbytes
        return out

    def _read(self, seg: TensorLocation) -> torch.Tensor:
        raw = self.reader.read(seg.path, seg.offset, seg.nbytes)
        return torch.frombuffer(raw, dtype=torch_dtype(seg.dtype))

    def close(self) -> None:
        self.reader.close()


def _one_span(segs: list[TensorLocation], slack: float = 0.25) -> tuple[int, int] | None:
    """(start, end) of one byte range of one file covering every segment, when they are (nearly)
    adjacent: at most `slack` of the range is bytes no segment needs. None otherwise. A single
    segment (a quantized sidecar's expert) is its own span: it too is read into the thread's
    reusable buffer, not a fresh one whose pages the kernel must zero and, on munmap, flush."""
    if not segs or len({s.path for s in segs}) != 1:
        return None
    start, end = min(s.offset for s in segs), max(s.offset + s.nbytes for s in segs)
    return (start, end) if end - start <= (1 + slack) * sum(s.nbytes for s in segs) else None


def _pack(parts: list[torch.Tensor], into: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate segments into one flat buffer in [gate | up | down] order (see expert_layout);
    straight into `into` (a contiguous host tensor of their dtype and total size) where given.

    Through numpy, on bytes: this runs on a transfer thread, where torch.cat's OpenMP team would
    compete with the compute thread's (see transfers._host_copy)."""
    if len({p.dtype for p in parts}) != 1:
        return torch.cat([p.reshape(-1) for p in parts])
    raw = [p.reshape(-1).view(torch.uint8).numpy() for p in parts]
    if (
        into is not None
        and into.device.type == "cpu"
        and into.dtype == parts[0].dtype
        and into.is_contiguous()
        and into.numel() == sum(p.numel() for p in parts)
    ):
        # One copy from the read buffer into the slot, instead of a new buffer and a second copy.
        np.concatenate(raw, out=into.view(-1).view(torch.uint8).numpy())
        return into
    return torch.from_numpy(np.concatenate(raw)).view(parts[0].dtype)
