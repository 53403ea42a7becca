"""engine/huge_pages.py: buffers the kernel is asked to back with transparent huge pages."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.huge_pages import HUGE_PAGE, MIN_BYTES, _madvise, huge_empty, rehome_untouched


def vma_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr`, from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is a Linux call"
)


@needs_linux
def test_large_buffer_is_aligned_and_advised() -> None:
    assert _madvise() is not None
    t = huge_empty((3, MIN_BYTES // 2), torch.bfloat16)  # 3 * MIN_BYTES bytes
    assert t.shape == (3, MIN_BYTES // 2) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == 3 * MIN_BYTES + HUGE_PAGE
    assert "hg" in vma_flags(t.data_ptr())
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))  # the memory is usable
    assert float(t[2, -1]) == float(torch.tensor(t.numel() - 1, dtype=torch.bfloat16))


@needs_linux
def test_small_buffer_and_other_devices_are_left_alone() -> None:
    small = huge_empty((16, 16), torch.float32)
    assert small.shape == (16, 16)
    assert small.untyped_storage().nbytes() == 16 * 16 * 4  # a plain allocation: no alignment slack
    t = torch.empty(MIN_BYTES, dtype=torch.uint8, device="meta")
    assert rehome_untouched(t) is t
    tiny = torch.empty(8)
    assert rehome_untouched(tiny) is tiny


@needs_linux
def test_rehome_keeps_shape_and_dtype() -> None:
    t = torch.empty((MIN_BYTES // 4 + 5,), dtype=torch.float32)
    h = rehome_untouched(t)
    assert h is not t and h.shape == t.shape and h.dtype == t.dtype
    assert "hg" in vma_flags(h.data_ptr())


def test_config_flag() -> None:
    assert EngineConfig().huge_pages is True
    assert EngineConfig(huge_pages=False).huge_pages is False
