"""The native kernels' headers (engine/native/*.h, issue 52): each compiles included first in an empty C file,
under every variant's flags it is meant for (an ISA header only where simd.h includes it), so none relies on
what a source defines before including it; their includes form no circle; and every one keys the build cache."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from engine.native import build as native_build
from engine.native.variants import buildable

HERE = Path(native_build.__file__).parent
HEADERS = sorted(p.name for p in HERE.glob("*.h"))
# The ISA headers and the macros simd.h includes each under: elsewhere they stop with #error, by design.
NEEDS = {"simd_avx512.h": ("__AVX512F__",), "simd_avx2.h": ("__AVX2__", "__FMA__")}

needs_cc = pytest.mark.skipif(native_build.compiler() is None, reason="needs a C compiler")


def _defined(cc: str, flags: tuple[str, ...]) -> set[str]:
    """The macros the compiler predefines under `flags`."""
    out = subprocess.run(
        [cc, *flags, "-dM", "-E", "-x", "c", "-"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@needs_cc
@pytest.mark.parametrize("name", [v.name for v in buildable()])
def test_every_header_compiles_on_its_own(name: str) -> None:
    (variant,) = [v for v in buildable() if v.name == name]
    cc = native_build.compiler()
    assert cc is not None
    have = _defined(cc, variant.flags)
    for header in HEADERS:
        if not set(NEEDS.get(header, ())) <= have:
            continue
        res = subprocess.run(
            [
                cc,
                *native_build.FLAGS,
                *native_build.DEFINES,
                *variant.flags,
                "-fsyntax-only",
                "-x",
                "c",
                "-I",
                str(HERE),
                "-",
            ],
            input=f'#include "{header}"\n',
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, f"{header} ({name}): {res.stderr}"


def test_includes_form_no_circle() -> None:
    local = {h: re.findall(r'^#include "([^"]+)"', (HERE / h).read_text(), re.M) for h in HEADERS}

    def visit(h: str, path: tuple[str, ...]) -> None:
        assert h not in path, " -> ".join((*path, h))
        for inc in local.get(h, []):
            visit(inc, (*path, h))

    for h in HEADERS:
        visit(h, ())


def test_every_header_keys_the_build_cache() -> None:
    assert sorted(p.name for p in native_build.HEADERS) == HEADERS
