"""Builds engine/native/cpu_gemv.c and decode_layer.c into a shared library once per machine, and loads it.

The library is compiled for the CPU it runs on (`-march=native`), so it is built where it is used,
not shipped: on first use, into a cache folder keyed by the source, the compiler and the CPU's
feature flags (`$MOE_OFFLOAD_CACHE/native`, else `$XDG_CACHE_HOME/moe-offload/native`, default
`~/.cache/moe-offload/native`). A build takes
about two seconds. Where no C compiler is found (`$CC`, else `gcc` or `cc`), or the build fails,
the engine says why once and keeps torch's kernels; `--native-kernels off` turns the native
kernels off (engine/native/loaded.py `use_native_kernels`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine import env

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_gemv.c", HERE / "decode_layer.c"]
HEADERS = [HERE / "cpu_gemv.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cache_dir() -> Path:
    return env.cache_root() / "native"


def compiler() -> str | None:
    for cc in (env.c_compiler_override(), "gcc", "cc"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cpu_flags() -> str:
    """The feature flags -march=native compiles for (a library built for another CPU may not run here)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(f.read_text() for f in SOURCES + HEADERS),
                cc,
                version,
                " ".join(FLAGS),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"cpu_gemv-{key}.so"


def build() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or None and one line saying why not."""
    cc = compiler()
    if cc is None:
        return (
            None,
            "no C compiler found (set CC, or install gcc): native CPU kernels off, using torch's",
        )
    path = library_path(cc)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent first uses (server and tests) never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        res = subprocess.run(
            [cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            os.unlink(tmp)
            first = (res.stderr.strip().splitlines() or ["no output"])[0]
            return (
                None,
                f"building the native CPU kernels with {cc} failed ({first}): using torch's",
            )
        os.replace(tmp, path)
    try:
        return ctypes.CDLL(str(path)), ""
    except OSError as e:
        return None, f"loading the native CPU kernels failed ({e}): using torch's"
