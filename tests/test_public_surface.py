"""engine/__init__.py: the public names server/, cli/ and bench/ import, each from the module that
defines it, loaded on first use (`.importlinter`'s engine-public-surface contract keeps those packages
off the submodules; these tests keep the surface itself honest and light)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parent.parent
INIT = ROOT / "engine" / "__init__.py"


def _typed_names() -> dict[str, str]:
    """The names engine/__init__.py imports under TYPE_CHECKING (what mypy sees): name -> source."""
    tree = ast.parse(INIT.read_text())
    guard = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    out: dict[str, str] = {}
    for node in guard.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.unparse(node)
        for alias in node.names:
            name = alias.asname or alias.name
            assert name not in out, f"{name} imported twice"
            out[name] = node.module if name == alias.name else f"{node.module}:{alias.name}"
    return out


def test_the_typed_imports_and_the_lazy_map_name_the_same_sources() -> None:
    assert _typed_names() == dict(engine._SOURCES)
    assert sorted(engine.__all__) == sorted(engine._SOURCES)


@pytest.mark.parametrize("name", engine.__all__)
def test_each_public_name_is_its_modules_object(name: str) -> None:
    module, _, attribute = engine._SOURCES[name].partition(":")
    assert getattr(engine, name) is getattr(importlib.import_module(module), attribute or name)


def test_no_public_name_is_a_submodule_name() -> None:
    # A loaded submodule is an attribute of the package and would win over __getattr__.
    subs = {p.stem for p in INIT.parent.glob("*.py")} | {
        p.name for p in INIT.parent.iterdir() if (p / "__init__.py").exists()
    }
    assert set(engine.__all__) & subs == set()


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        engine.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from engine import no_such_name", {})


def test_importing_engine_imports_no_submodule_and_a_light_name_no_torch() -> None:
    # The front end and `moe-offload --help` import only what they name, as with the submodules.
    code = (
        "import sys, engine; "
        "assert not [m for m in sys.modules if m.startswith('engine.')], sorted(sys.modules); "
        "from engine import ConfigError, CoreLimits, EngineConfig, SamplingParams, add_flags; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_server_cli_and_bench_reach_no_submodule_through_the_package() -> None:
    # `import engine` then `engine.core.x` would get past import-linter: no such attribute chains.
    subs = {p.stem for p in INIT.parent.glob("*.py")} | {p.name for p in INIT.parent.iterdir()}
    found = []
    for package in ("server", "cli", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "engine"
                    and node.attr in subs
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
