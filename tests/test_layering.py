"""The package graph is one-way (.importlinter): CI runs import-linter's contracts here, and checks
that every engine package has a place in the layers, so a new package cannot escape them."""

from __future__ import annotations

import configparser
from pathlib import Path

from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    configuration.configure()  # what the lint-imports command does first (readers, graph builder)
    assert lint_imports(
        config_filename=str(ROOT / ".importlinter"), cache_dir=None, no_logo=True
    ), "see the report above"


def test_every_engine_package_is_in_a_layer() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    layers = cfg["importlinter:contract:engine-layers"]["layers"]
    named = {m.strip() for line in layers.splitlines() for m in line.split("|") if m.strip()}
    engine = ROOT / "engine"
    packages = {f"engine.{p.name}" for p in engine.iterdir() if (p / "__init__.py").exists()}
    modules = {f"engine.{p.stem}" for p in engine.glob("*.py") if p.stem != "__init__"}
    assert packages - named == set(), (
        "a package of engine/ that the layering contract does not place"
    )
    assert modules - named == set(), "a module of engine/ that the layering contract does not place"
    assert named <= packages | modules, "the layering contract names a module that does not exist"
