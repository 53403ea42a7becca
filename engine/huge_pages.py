"""Host buffers backed by transparent huge pages (2 MiB) where Linux offers them.

A decode step streams every dense weight and every routed expert it uses from memory once. With 4 KiB
pages such a stream crosses a page, and misses the TLB, every 4 KiB; with 2 MiB pages 512 times less
often (measured: docs/benchmarks/engine.md, bench/huge_pages_ab.py).

Most distributions set transparent huge pages to `madvise`: a region gets them only when asked, with
madvise(MADV_HUGEPAGE), before its pages are first touched. So `huge_empty` allocates a little more than
asked, aligns the start to 2 MiB, advises the range and returns an untouched view: the first write
(the load's copy) faults huge pages in. Where the kernel has them off (`never`), on other systems, or for
buffers too small to hold one huge page, it is a plain torch.empty: same values, same results.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from collections.abc import Callable
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE  # below this the saving is small and the 2 MiB of alignment slack is not
MADV_HUGEPAGE = 14  # linux/mman.h


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None where there is no such call to make."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of `shape` and `dtype` whose pages the kernel is asked to back with
    huge pages (see the module docstring); a plain torch.empty where that cannot apply."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    buf = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = (-buf.data_ptr()) % HUGE_PAGE
    # Advise whole huge pages only: the tail past the last 2 MiB boundary stays in small pages.
    if madvise(buf.data_ptr() + start, nbytes - nbytes % HUGE_PAGE, MADV_HUGEPAGE) != 0:
        return torch.empty(shape, dtype=dtype)  # e.g. EINVAL on a kernel built without THP
    return buf[start : start + nbytes].view(dtype).view(shape)


def empty(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    huge_pages: bool,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An uninitialized tensor: huge_empty where `huge_pages` asks for it and it is on the CPU, else a
    plain torch.empty (EngineConfig.huge_pages decides, per buffer the decode streams)."""
    if huge_pages and torch.device(device).type == "cpu":
        return huge_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def rehome_untouched(t: torch.Tensor) -> torch.Tensor:
    """A huge-page-advised replacement for `t`, a CPU tensor whose values do not matter yet (just
    allocated, to be filled): the same shape and dtype, or `t` itself where it is too small or not on
    the CPU."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES:
        return t
    return huge_empty(tuple(t.shape), t.dtype)


MADV_DONTNEED = 4  # linux/mman.h
PAGE = 4096


def release_pages(t: torch.Tensor) -> int:
    """Give the OS back the memory of the whole pages inside `t`, a contiguous CPU tensor whose values are
    no longer needed (a KV block or an expert slot the memory split took out of use): madvise(MADV_DONTNEED)
    on private anonymous memory, so the next read of such a page sees zeros and the next write faults in a
    fresh one. The partial pages at either end are left alone (a neighbour may live there). Returns the
    bytes released (0 where the call does not exist or fails)."""
    madvise = _madvise()
    if madvise is None or t.device.type != "cpu" or not t.is_contiguous():
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last <= first or madvise(first, last - first, MADV_DONTNEED) != 0:
        return 0
    return last - first
