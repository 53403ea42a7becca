"""Reads byte ranges from checkpoint files without letting the page cache keep them.

On a CPU box the RAM budget for experts is only real if the kernel does not quietly
cache the whole checkpoint. We prefer O_DIRECT (aligned reads straight from the
device); where a filesystem refuses it (tmpfs, some overlays) we fall back to a plain
pread followed by posix_fadvise(DONTNEED), which drops the pages we just read.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

from engine.errors import CheckpointError
from engine.experts.tiers.read_faults import ReadFaults

_ALIGN = 4096


class ReadClock:
    """What the reads alone achieved: bytes read and the wall time with at least one read in
    flight (reads overlap on several transfer threads, so per-read times would count twice).
    bytes / busy_seconds is the disk's delivered bandwidth, comparable with `dd iflag=direct`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self.bytes = 0
        self.reads = 0
        self.busy_seconds = 0.0

    def start(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

    def stop(self, nbytes: int) -> None:
        """One read ended, having delivered `nbytes` (0 when it failed)."""
        with self._lock:
            self._inflight -= 1
            self.bytes += nbytes
            self.reads += nbytes > 0
            if self._inflight == 0:
                self.busy_seconds += time.perf_counter() - self._since

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"bytes": self.bytes, "reads": self.reads, "busy_seconds": self.busy_seconds}


class UncachedReader:
    """Thread-safe reader: one file descriptor per file, reads via pread (no shared offset)."""

    def __init__(self, prefer_direct: bool = True) -> None:
        self._prefer_direct = prefer_direct and hasattr(os, "O_DIRECT")
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self._scratch = (
            threading.local()
        )  # per thread: one reusable aligned buffer (read(scratch=True))
        self.clock = ReadClock()
        self.faults: ReadFaults | None = None  # injected faults (DiskTier.set_faults): short reads

    @property
    def modes(self) -> dict[str, str]:
        """Which mode each open file uses, for reports: 'O_DIRECT' or 'pread+DONTNEED'."""
        return {str(p): ("O_DIRECT" if d else "pread+DONTNEED") for p, (_, d) in self._fds.items()}

    def _fd(self, path: Path) -> tuple[int, bool]:
        with self._lock:
            if path not in self._fds:
                fd, direct = -1, False
                if self._prefer_direct:
                    try:
                        fd, direct = os.open(path, os.O_RDONLY | os.O_DIRECT), True
                    except OSError:
                        fd = -1
                if fd < 0:
                    fd = os.open(path, os.O_RDONLY)
                self._fds[path] = (fd, direct)
            return self._fds[path]

    def read(self, path: Path, offset: int, nbytes: int, scratch: bool = False) -> memoryview:
        """Return exactly `nbytes` bytes at `offset`, or raise CheckpointError naming the file.
        `scratch`: with O_DIRECT, read into this thread's reusable aligned buffer; the view is then
        valid only until the thread's next scratch read (callers that copy it at once: the disk
        tier). A fresh buffer per read costs an mmap and a munmap, and munmap interrupts every
        core running this process to flush its TLB."""
        self.clock.start()
        got = 0
        try:
            view = self._read(path, offset, nbytes, scratch)
            got = nbytes
            return view
        finally:
            self.clock.stop(got)

    def _read(self, path: Path, offset: int, nbytes: int, scratch: bool) -> memoryview:
        fd, direct = self._fd(path)
        if direct:
            try:
                return self._read_direct(fd, path, offset, nbytes, scratch)
            except OSError:
                # Some filesystems accept O_DIRECT at open but fail reads; switch this file over.
                with self._lock:
                    os.close(fd)
                    self._fds[path] = (os.open(path, os.O_RDONLY), False)
                fd, _ = self._fds[path]
        data = self._pread(fd, nbytes, offset)
        if len(data) != nbytes:
            raise CheckpointError(
                f"{path}: truncated: wanted {nbytes} bytes at offset {offset}, got {len(data)}"
            )
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return memoryview(data)

    def _read_direct(
        self, fd: int, path: Path, offset: int, nbytes: int, scratch: bool = False
    ) -> memoryview:
        start = offset - offset % _ALIGN
        end = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        if scratch:
            buf = getattr(self._scratch, "buf", None)
            if buf is None or len(buf) < end - start:
                buf = self._scratch.buf = mmap.mmap(
                    -1, max(end - start, 1 << 20)
                )  # page-aligned, as O_DIRECT needs
        else:
            buf = mmap.mmap(-1, end - start)  # anonymous mmap is page-aligned, as O_DIRECT needs
        got = self._preadv(fd, memoryview(buf)[: end - start], start)
        if got < offset + nbytes - start:
            raise CheckpointError(
                f"{path}: truncated: wanted {nbytes} bytes at offset {offset}, file ended first"
            )
        return memoryview(buf)[offset - start : offset - start + nbytes]

    def _ask(self, want: int, align: int) -> int:
        return want if self.faults is None else self.faults.cut(want, align)

    def _pread(self, fd: int, nbytes: int, offset: int) -> bytes:
        """os.pread until `nbytes` bytes or the end of the file. A read may return fewer bytes than
        asked (a signal, a network filesystem, an injected `short` fault) without the file ending;
        only an empty read is its end."""
        parts: list[bytes] = []
        got = 0
        while got < nbytes:
            chunk = os.pread(fd, self._ask(nbytes - got, 1), offset + got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _preadv(self, fd: int, buf: memoryview, start: int) -> int:
        """os.preadv into `buf` until it is full or the file ends; bytes read. O_DIRECT reads
        return whole blocks except at the end of the file, so a partial block ends the loop."""
        got = 0
        while got < len(buf):
            want = self._ask(len(buf) - got, _ALIGN)
            n = os.preadv(fd, [buf[got : got + want]], start + got)
            got += max(n, 0)
            if n <= 0 or n % _ALIGN:
                break
        return got

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
