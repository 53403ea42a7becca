"""Each serve setting and its default is defined once (issue 52, item 3): the scheduling limits in
engine/core/limits.py, the server's settings in server/config.py. ServeSettings, EngineArgs and the
command line derive from those dataclasses, so a copy that drifts fails here."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from cli.main import build_parser
from engine.core.limits import CoreLimits
from engine.launch import EngineArgs
from server.config import ServerConfig
from server.state import ServeSettings

REPO = Path(__file__).resolve().parent.parent
LIMITS = ("max_running", "prefill_token_budget")


def names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def test_serve_settings_copy_no_server_config_field() -> None:
    # served_model_name is the resolved name (the model directory's where the config names none).
    assert names(ServeSettings) & names(ServerConfig) == {"served_model_name"}
    assert "server" in names(ServeSettings)


def test_engine_args_hold_the_core_limits_instead_of_copies() -> None:
    assert names(EngineArgs) & names(CoreLimits) == set()
    assert {f.name: f.type for f in fields(EngineArgs)}["limits"] == "CoreLimits"


def test_serve_defaults_are_the_core_limits() -> None:
    for name in LIMITS:
        assert getattr(ServerConfig(), name) == getattr(CoreLimits(), name)


def test_help_states_the_default_the_flag_has() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in serve._actions}
    for name in LIMITS:
        action = actions[name]
        stated = re.search(r"\(default (\d+)\)", action.help or "")
        assert stated is not None, action.help
        assert int(stated.group(1)) == getattr(CoreLimits(), name)


def test_the_limit_defaults_are_written_once() -> None:
    """A field `max_running: int = 64` (or `= setting(64, ...)`, or prefill_token_budget's) anywhere
    in engine/, server/ or cli/ but engine/core/limits.py is a second definition of a default."""
    pattern = re.compile(rf"\b({'|'.join(LIMITS)})\s*:\s*int\s*=\s*(setting\(\s*)?\(?\s*\d")
    defined = {
        p.relative_to(REPO).as_posix()
        for root in ("engine", "server", "cli")
        for p in (REPO / root).rglob("*.py")
        if pattern.search(p.read_text())
    }
    assert defined == {"engine/core/limits.py"}


def test_forced_tools_come_from_the_server_config() -> None:
    scfg = ServerConfig(force_tool_call=("get_weather", 'lookup={"q": "x"}'))
    settings = ServeSettings(engine=None, served_model_name="m", server=scfg)  # type: ignore[arg-type]
    assert settings.forced_tools == (("get_weather", None), ("lookup", {"q": "x"}))


def test_core_limits_come_from_the_server_config_by_name() -> None:
    scfg = ServerConfig(max_running=3, prefill_token_budget=7)
    assert scfg.core_limits(99) == CoreLimits(
        max_running=3, prefill_token_budget=7, max_model_len=99
    )


def test_plan_takes_its_engine_settings_from_engine_config_as_serve_does() -> None:
    from cli.plan import PLAN_SETTINGS

    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    serve = {a.dest: a for a in choices["serve"]._actions}
    plan = {a.dest: a for a in choices["plan"]._actions}
    for name in PLAN_SETTINGS:
        assert plan[name].help == serve[name].help, name
        assert plan[name].choices == serve[name].choices, name
        assert plan[name].default is None, name  # not given: EngineConfig's default applies
