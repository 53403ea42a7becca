"""The native row limit is defined once (engine/native/limits.py): the C sources take it from the
build's -DMAX_ROWS, define none of their own, and a library built with another value is not reused."""

from __future__ import annotations

import re
import shutil

import pytest

from engine.native import build as native_build
from engine.native.limits import MAX_ROWS
from engine.native.variants import runnable


def test_the_build_passes_pythons_row_limit() -> None:
    assert f"-DMAX_ROWS={MAX_ROWS}" in native_build.DEFINES


def test_no_c_source_defines_the_row_limit_itself() -> None:
    for f in native_build.SOURCES + native_build.HEADERS:
        assert not re.search(r"#\s*define\s+\w*MAX_ROWS\b", f.read_text()), f.name


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler for the cache key")
def test_the_cache_key_holds_the_defines(monkeypatch) -> None:
    cc, variant = native_build.compiler(), runnable()[0]
    assert cc is not None
    before = native_build.library_path(cc, variant)
    monkeypatch.setattr(native_build, "DEFINES", [f"-DMAX_ROWS={MAX_ROWS * 2}"])
    assert native_build.library_path(cc, variant) != before
