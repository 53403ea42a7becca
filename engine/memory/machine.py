"""What this machine has free: device memory, host memory (MemAvailable, and the memory cgroup's
limit less its working set, v1 and v2) and the free space of a directory's file system.

Every reader takes its file paths as arguments so tests can point them at a fake /proc and
/sys/fs/cgroup; nothing is read at import time."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from engine.native.decode_shapes import NATIVE_OFF, DecodeShapes

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class HostMemory:
    available: int  # bytes a new allocation can take now
    source: str  # which bound decided it, for the plan table
    mem_available: int | None
    cgroup_headroom: int | None


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where the file has no such line)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("max", ""):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(proc_cgroup: Path, root: Path) -> list[tuple[str, Path]]:
    """("v1"|"v2", directory) of this process's memory cgroup and each ancestor, innermost first."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[str, Path]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if "memory" in controllers.split(","):
            version, base = "v1", root / "memory"
        elif controllers == "" and (root / "cgroup.controllers").exists():
            version, base = "v2", root
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            out.append((version, d))
            if d == base or base not in d.parents:
                break
            d = d.parent
    return out


def cgroup_headroom(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> tuple[int, str] | None:
    """(bytes, description) the tightest memory cgroup above this process still allows: its limit
    less its working set (usage without the inactive page cache, which the kernel reclaims first).
    v1: memory.limit_in_bytes, memory.usage_in_bytes, memory.stat total_inactive_file;
    v2: memory.max, memory.current, memory.stat inactive_file. None where no limit applies."""
    best: tuple[int, str] | None = None
    for version, d in _cgroup_dirs(proc_cgroup, root):
        if version == "v1":
            limit, usage = (
                _read_int(d / "memory.limit_in_bytes"),
                _read_int(d / "memory.usage_in_bytes"),
            )
            inactive = _stat(d / "memory.stat", "total_inactive_file")
        else:
            limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            inactive = _stat(d / "memory.stat", "inactive_file")
        if limit is None or limit >= 1 << 60:  # v1 reports "no limit" as a huge number
            continue
        free = max(0, limit - max(0, (usage or 0) - inactive))
        if best is None or free < best[0]:
            best = (free, f"cgroup {version} limit {limit} B")
    return best


def host_memory(
    meminfo: Path = Path("/proc/meminfo"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    root: Path = CGROUP_ROOT,
) -> HostMemory:
    avail = mem_available(meminfo)
    cg = cgroup_headroom(proc_cgroup, root)
    if avail is None:  # not Linux: what psutil-free Python can tell
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 1 << 34
    if cg is not None and cg[0] < avail:
        return HostMemory(cg[0], cg[1], avail, cg[0])
    return HostMemory(avail, "MemAvailable", avail, cg[0] if cg else None)


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (torch.cuda.mem_get_info), None on CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    return tuple(torch.cuda.mem_get_info(torch.device(device)))  # type: ignore[return-value]


def disk_free(path: str | Path) -> int:
    """Free bytes of the file system that holds `path` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def rss_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's resident set (VmRSS), 0 where unknown."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class KernelProbe(Protocol):
    """The native kernels this machine runs for a model: --native-kernels `mode` (auto, on, off), --native-build
    and --native-build-limit resolved at the model's decode `shapes` (None: not measured), as (the build's
    name, None for torch's kernels; the plan's line for it). Probing builds, loads and measures them on
    this CPU (engine/native/loaded.py `probe`: torch, a compiler, a cache per CPU and shape), so it is done
    by whoever gathers the machine's facts, not by the plan, which only reads the answer."""

    def __call__(
        self, mode: str, shapes: DecodeShapes | None, build: str, limit: str
    ) -> tuple[str | None, str]: ...


@dataclass(frozen=True)
class StatedKernels:
    """A kernel probe's answer stated, not probed (a test's machine, a plan made elsewhere): `build` (None:
    torch's kernels) with `line`, whatever the model; --native-kernels off still turns them off."""

    build: str | None = None
    line: str = "off: no native kernels stated for this machine"

    def __call__(
        self, mode: str, shapes: DecodeShapes | None, build: str, limit: str
    ) -> tuple[str | None, str]:
        return (None, NATIVE_OFF) if mode == "off" else (self.build, self.line)


@dataclass(frozen=True)
class Machine:
    """What a load plan is made against (engine/plan/resolve.py): the host's memory, the free bytes of
    the CUDA device the model computes on (None on a CPU), and the process's own bytes before loading
    (listed by a load's plan; 0 in a plan made ahead of it). `ahead`: a plan made before any load (serve's
    check, `moe-offload plan`), which lists the quantized-expert file still to be written and checks it
    against `quant_disk_free`; a load writes that file and plans none. `kernels`: the native kernels this
    machine runs for a model (`KernelProbe`; stated: none). `device`: the device the model computes on, as
    engine/weights/model_config.py `resolve_device` found it ("cpu", "cuda", "cuda:N")."""

    host: HostMemory
    device_free: int | None = None
    runtime_bytes: int = 0
    quant_disk_free: int | None = None
    ahead: bool = False
    kernels: KernelProbe = field(default_factory=StatedKernels)
    device: str = "cpu"


def this_machine(device: str, at_load: bool, quant_dir: str | Path | None = None) -> Machine:
    """This machine, measured now, for a model computing on `device` ("cpu", "cuda" or "cuda:N"):
    `at_load`, the load's own plan (its runtime measured); else a plan ahead of it, with the free
    disk of `quant_dir` where a quantized-expert file would be written (None: none will be); its native
    kernels probed on this CPU (engine/native/loaded.py `probe`)."""
    from engine.native.loaded import probe

    free = device_memory("cuda:0" if device == "cuda" else device)
    return Machine(
        host_memory(),
        device_free=free[0] if free else None,
        runtime_bytes=rss_bytes() if at_load else 0,
        quant_disk_free=disk_free(quant_dir) if quant_dir is not None and not at_load else None,
        ahead=not at_load,
        kernels=probe,
        device=device,
    )
