"""Builds the native kernels (engine/native/cpu_gemv.c, gemm.c, decode_layer.c, mxfp4_moe.c, entry.c) into one
shared library per variant (engine/native/variants.py), once per machine, and loads them.

A variant is built on first use, into a cache folder keyed by the sources, the compiler, the defines and the
variant's flags (`$MOE_OFFLOAD_CACHE/native`, else `$XDG_CACHE_HOME/moe-offload/native`, default
`~/.cache/moe-offload/native`); a build takes about two seconds. Where no C compiler is found
(`$CC`, else `gcc` or `cc`), or the build fails, the engine says why once and keeps torch's
kernels; `--native-kernels off` turns the native kernels off (engine/native/loaded.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine import env
from engine.native.limits import MAX_HEAD_GROUP, MAX_ROWS, MAX_TOPK
from engine.native.variants import Variant, runnable

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [
    HERE / "cpu_gemv.c",
    HERE / "attention.c",
    HERE / "gemm.c",
    HERE / "decode_layer.c",
    HERE / "mxfp4_moe.c",
    HERE / "entry.c",
]
# Every header beside the sources (cpu_gemv.h, kernel_common.h, simd.h, simd_*.h, gemm_kernels.h, ...), so a new
# or changed one is part of the cache key (library_path) and a stale build is never reused.
HEADERS = sorted(HERE.glob("*.h"))
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# The limits the C sources take from Python (engine/native/limits.py), so the two cannot disagree; part of
# the cache key, so a library built with other values is not reused.
DEFINES = [f"-DMAX_ROWS={MAX_ROWS}", f"-DMAX_TOPK={MAX_TOPK}", f"-DMAX_HEAD_GROUP={MAX_HEAD_GROUP}"]


def cache_dir() -> Path:
    return env.cache_root() / "native"


def compiler() -> str | None:
    for cc in (env.c_compiler_override(), "gcc", "cc"):
        if cc and shutil.which(cc):
            return cc
    return None


def library_path(cc: str, variant: Variant) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(f.read_text() for f in SOURCES + HEADERS),
                cc,
                version,
                " ".join(FLAGS),
                " ".join(DEFINES),
                " ".join(variant.flags),
            ]
        ).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"cpu_gemv-{variant.name}-{key}.so"


def build(variant: Variant | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The loaded library of `variant` (default: the widest this CPU runs), or None and one line saying why
    not. Any variant builds on any x86-64 machine (tests build every one); calling into one the CPU cannot
    run would fault, so callers load those engine/native/variants.py `runnable` lists."""
    variant = variant or runnable()[0]
    cc = compiler()
    if cc is None:
        return (
            None,
            "no C compiler found (set CC, or install gcc): native CPU kernels off, using torch's",
        )
    path = library_path(cc, variant)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent first uses (server and tests) never see half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        res = subprocess.run(
            [cc, *FLAGS, *DEFINES, *variant.flags, "-o", tmp, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            os.unlink(tmp)
            first = (res.stderr.strip().splitlines() or ["no output"])[0]
            return (
                None,
                f"building the native CPU kernels ({variant.name}) with {cc} failed ({first}): using torch's",
            )
        os.replace(tmp, path)
    try:
        return ctypes.CDLL(str(path)), ""
    except OSError as e:
        return None, f"loading the native CPU kernels ({variant.name}) failed ({e}): using torch's"
