"""The native limits are defined once (engine/native/limits.py): the C sources take them from the build's
-DMAX_ROWS, -DMAX_TOPK and -DMAX_HEAD_GROUP, define none of their own, and a library built with another
value is not reused."""

from __future__ import annotations

import re
import shutil

import pytest

from engine.native import build as native_build
from engine.native.limits import MAX_HEAD_GROUP, MAX_ROWS, MAX_TOPK
from engine.native.variants import runnable


def test_the_build_passes_pythons_limits() -> None:
    assert f"-DMAX_ROWS={MAX_ROWS}" in native_build.DEFINES
    assert f"-DMAX_TOPK={MAX_TOPK}" in native_build.DEFINES
    assert f"-DMAX_HEAD_GROUP={MAX_HEAD_GROUP}" in native_build.DEFINES


def test_no_c_source_defines_a_limit_itself_or_writes_its_value() -> None:
    for f in native_build.SOURCES + native_build.HEADERS:
        text = f.read_text()
        assert not re.search(r"#\s*define\s+\w*(MAX_ROWS|MAX_TOPK|MAX_HEAD_GROUP)\b", text), f.name
        # the experts-a-row and heads-a-group limits were once a literal 64 in several kernels
        assert not re.search(r"(k|m|group) > 64\b|\[64\]", text), f.name


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler for the cache key")
def test_the_cache_key_holds_the_defines(monkeypatch) -> None:
    cc, variant = native_build.compiler(), runnable()[0]
    assert cc is not None
    before = native_build.library_path(cc, variant)
    monkeypatch.setattr(native_build, "DEFINES", [f"-DMAX_ROWS={MAX_ROWS * 2}"])
    assert native_build.library_path(cc, variant) != before
