"""Run a benchmark's child process under a memory limit, from a cold page cache.

A memory cgroup caps everything the child charges: its anonymous memory and the page cache of
the files it reads, which is what decides a bigger-than-RAM model's speed (llama.cpp's mmap
keeps re-reading evicted pages; this engine reads experts with uncached I/O into a fast tier it
sizes itself). Uses cgroup v2 where the unified hierarchy offers the memory controller, else v1
(`memory.limit_in_bytes`). Needs write access to the cgroup file system (root, or a delegated
subtree); `MemoryCgroup.unavailable()` says why not where it is missing.

Cold cache: before each run the model files' pages are dropped from the page cache
(posix_fadvise DONTNEED, which works on clean pages without root), and the group's own charged
pages are reclaimed (v1 `memory.force_empty`; in v2 the group is emptied by lowering and
restoring its limit).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")


def _v2_has_memory() -> Path | None:
    """The unified hierarchy's mount point if its root offers the memory controller to children."""
    for root in (V2_ROOT, V2_ROOT / "unified"):
        ctl = root / "cgroup.subtree_control"
        if ctl.exists() and "memory" in ctl.read_text().split():
            return root
    return None


class MemoryCgroup:
    """A fresh memory cgroup with `limit` bytes; `run` starts children inside it."""

    def __init__(self, limit: int, name: str = f"moe-offload-bench-{os.getpid()}") -> None:
        self.limit = limit
        v2 = _v2_has_memory()
        self.version = 2 if v2 is not None else 1
        self.path = (v2 if v2 is not None else V1_ROOT) / name
        self.path.mkdir(exist_ok=True)
        self._set_limit(limit)

    @staticmethod
    def unavailable() -> str | None:
        """None when a memory cgroup can be made here, else one line saying why not."""
        root = _v2_has_memory() or (
            V1_ROOT if (V1_ROOT / "memory.limit_in_bytes").exists() else None
        )
        if root is None:
            return "no memory cgroup controller is mounted (neither cgroup v2 with 'memory' nor v1 /sys/fs/cgroup/memory)"
        if not os.access(root, os.W_OK):
            return f"{root} is not writable: run as root or in a delegated cgroup subtree"
        return None

    def _limit_file(self) -> Path:
        return self.path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes")

    def _set_limit(self, limit: int) -> None:
        self._limit_file().write_text(str(limit))

    def set_limit(self, limit: int) -> None:
        """Change the limit of a running group. v1 refuses (EBUSY, an OSError) a limit below what
        it cannot reclaim; v2 then lets its OOM killer act."""
        self._set_limit(limit)
        self.limit = limit

    def usage(self) -> int:
        """Bytes charged to the group now (anonymous memory and page cache)."""
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        return int((self.path / name).read_text())

    def anon(self) -> int:
        """Bytes of anonymous memory charged to the group (what reclaim cannot drop without swap)."""
        key = "anon" if self.version == 2 else "total_rss"
        for line in (self.path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def drop_charged_pages(self) -> None:
        """Reclaim the page cache charged to this group, so the next run starts cold."""
        if self.version == 1:
            try:
                (self.path / "memory.force_empty").write_text("0")
            except OSError:
                pass  # refused while a task is inside; there is none between runs
        else:
            self._set_limit(0)
            self._set_limit(self.limit)

    def run(
        self, argv: Sequence[str], cold: Sequence[Path] = (), timeout: float = 3600
    ) -> subprocess.CompletedProcess:
        """Run argv inside the group (stdout/stderr captured as text), after evicting `cold` files."""
        for f in cold:
            evict_page_cache(f)
        self.drop_charged_pages()
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, preexec_fn=self.enter
        )

    def enter(self) -> None:
        """Move the calling process into the group: a child's preexec_fn (between fork and exec)."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def peak_bytes(self) -> int:
        """The most memory the group has charged (v2 memory.peak, v1 memory.max_usage_in_bytes); 0 where unknown."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for memory, so far (v2 memory.events, v1 memory.oom_control)."""
        events = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def evict_page_cache(path: Path) -> None:
    """Drop a file's (or a folder's files') clean pages from the page cache."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
