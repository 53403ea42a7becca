"""Shared loading of frozen settings dataclasses from a section of a YAML file."""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from engine.errors import ConfigError

T = TypeVar("T", bound="YamlSection")


class YamlSection:
    """Mixin for frozen dataclasses: `from_yaml` reads section SECTION; `with_overrides` applies flags."""

    SECTION: ClassVar[str]

    def with_overrides(self: T, **overrides: Any) -> T:
        """Flags on top of file settings; None means 'not given on the command line'."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_yaml(cls: type[T], path: str | Path) -> T:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
        section = (data.get(cls.SECTION) or {}) if isinstance(data, dict) else None
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: expected a mapping with '{cls.SECTION}:' settings")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown {cls.SECTION} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**section)
