from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError
from policies import make_eviction, make_miss_policy

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_shipped_configs_load() -> None:
    for f in CONFIGS.glob("*.yaml"):
        EngineConfig.from_yaml(f).policies()
    assert EngineConfig.from_yaml(CONFIGS / "offload-disk-25.yaml").offload == "disk"


def test_flags_override_file(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  cache_fraction: 0.5\n  offload: disk\n")
    cfg = EngineConfig.from_yaml(f).with_overrides(cache_fraction=0.25, offload=None)
    assert (cfg.cache_fraction, cfg.offload) == (0.25, "disk")


@pytest.mark.parametrize(
    "text, message",
    [
        ("engine:\n  cache_fraction: 0\n", "cache_fraction must be in"),
        ("engine:\n  offload: tape\n", "offload must be"),
        ("engine:\n  colour: red\n", "unknown engine setting"),
        ("engine: [1, 2\n", "invalid YAML"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, text: str, message: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        EngineConfig.from_yaml(f)
    assert "\n" not in str(e.value)


def test_unknown_policy_names() -> None:
    with pytest.raises(ValueError, match="unknown miss policy 'nope'"):
        make_miss_policy("nope")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_eviction("nope")
    with pytest.raises(ConfigError, match="unknown miss policy 'fastest'"):
        EngineConfig(policy="fastest").policies()
