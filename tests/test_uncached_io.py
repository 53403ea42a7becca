from __future__ import annotations

import os

import pytest

from engine.errors import CheckpointError
from engine.experts.uncached_io import UncachedReader


def _supports_o_direct(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("prefer_direct", [True, False])
def test_reads_exact_bytes_at_unaligned_offsets(tmp_path, prefer_direct: bool) -> None:
    data = os.urandom(3 * 4096 + 123)
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    r = UncachedReader(prefer_direct=prefer_direct)
    for off, n in [(0, 10), (1, 4096), (4095, 2), (5000, 7000), (len(data) - 5, 5)]:
        assert bytes(r.read(f, off, n)) == data[off : off + n]
    # The mode used is the one this file system allows: probe O_DIRECT independently.
    assert r.modes[str(f)] == ("O_DIRECT" if prefer_direct and _supports_o_direct(f) else "pread+DONTNEED")
    with pytest.raises(CheckpointError, match="truncated"):
        r.read(f, len(data) - 5, 50)
    r.close()
