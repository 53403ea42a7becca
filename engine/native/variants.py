"""The builds of the native kernels: one per instruction-set level, and which of them this CPU runs.

The C source (engine/native/cpu_gemv.c and the simd_*.h headers it includes) compiles to a different
library for each variant below, each with explicit `-march` flags rather than `-march=native`, so any
x86-64 machine can build (and the tests check) every variant, and a machine runs those its CPU has the
instructions for: on an AMD EPYC with AVX2 only, the old single build (`-march=native`, whose fast
paths were AVX-512 only) decoded at half of torch's speed. An engine runs the widest build its CPU runs
(engine/native/loaded.py), not the one a measurement finds fastest: builds differ in lane counts and dot
products, so each computes its own bits, and a timed choice could switch the numeric family between two
loads of one model on one machine.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    """One build of the native kernels: its name, its compiler flags, and the CPU flags it needs (as
    /proc/cpuinfo names them; empty for the portable build, which runs anywhere the compiler targets)."""

    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]
    x86_only: bool = True


# Widest first: `auto` runs the first one this CPU runs (engine/native/loaded.py).
VARIANTS: tuple[Variant, ...] = (
    Variant(
        "avx512-bf16",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"),
    ),
    # AVX-512 with VNNI but no BF16 (Intel Cascade Lake, Ice Lake; AMD Zen 4 has both): int8 dot products in
    # one instruction, for int8 and int4 weights.
    Variant(
        "avx512-vnni",
        ("-march=x86-64-v4", "-mavx512vnni"),
        ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"),
    ),
    Variant("avx512", ("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    Variant("avx2", ("-march=x86-64-v3",), ("avx2", "fma", "f16c", "bmi2", "movbe")),
    # The compiler's default target: SSE2 on x86-64, NEON (Advanced SIMD) on AArch64.
    Variant("portable", (), (), x86_only=False),
)


def by_name(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise KeyError(name)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo `flags`, or `Features` on ARM); empty elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (for the plan line and the measurement cache's key)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def buildable() -> tuple[Variant, ...]:
    """The variants this machine's compiler targets (every x86 one on x86-64; the portable one elsewhere)."""
    return tuple(v for v in VARIANTS if is_x86() or not v.x86_only)


def runnable(flags: frozenset[str] | None = None, limit: str = "auto") -> tuple[Variant, ...]:
    """The variants this CPU has the instructions for, widest first; with `limit` a variant's name, only
    that one and those narrower (EngineConfig.native_build_limit: a wider CPU choosing as a narrower one
    would)."""
    have = cpu_flags() if flags is None else flags
    widest = 0 if limit == "auto" else VARIANTS.index(by_name(limit))
    return tuple(v for v in buildable() if set(v.needs) <= have and VARIANTS.index(v) >= widest)
