"""Frozen settings dataclasses: loaded from a section of a YAML file, and turned into flags."""

from __future__ import annotations

from dataclasses import field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args, get_origin, get_type_hints

import yaml

from engine.errors import ConfigError

T = TypeVar("T", bound="YamlSection")


class YamlSection:
    """Mixin for frozen dataclasses: `from_yaml` reads section SECTION; `with_overrides` applies flags."""

    SECTION: ClassVar[str]

    def with_overrides(self: T, **overrides: Any) -> T:
        """Flags on top of file settings; None means 'not given on the command line'."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[type-var]  # T: a dataclass (every YamlSection is one)

    @classmethod
    def from_yaml(cls: type[T], path: str | Path) -> T:
        return cls(**cls.yaml_section(path))

    @classmethod
    def keys_in_yaml(cls, path: str | Path) -> frozenset[str]:
        """The settings the file's section gives (every other one keeps its default)."""
        return frozenset(cls.yaml_section(path))

    @classmethod
    def yaml_section(cls, path: str | Path) -> dict[str, Any]:
        """The file's SECTION mapping, checked: a ConfigError names a bad file or unknown key."""
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
            raise ConfigError(
                f"{path}: unknown {cls.SECTION} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return section


# -- command-line flags generated from the settings dataclasses (one source of truth) -----------


def setting(
    default: Any,
    help: str,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field that also describes its command-line flag.

    flag: the option string (default --field-name; for a bool that defaults to True, give the
    negative form such as --no-warm). repeat: the flag may be given several times (a tuple).
    """
    return field(
        default=default,
        metadata={
            "help": help,
            "metavar": metavar,
            "choices": choices,
            "flag": flag,
            "repeat": repeat,
        },
    )


def _base_type(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_flags(
    group: Any, cls: type, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> None:
    """Add one argparse flag per `setting` field of `cls` (with `only`, those fields alone); its
    default is None ('not given'), so file settings apply unless a flag overrides them."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta or f.name in skip or (only is not None and f.name not in only):
            continue
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "help": meta["help"], "default": None}
        if tp is bool:
            kw["action"] = "store_const"
            kw["const"] = not f.default if flag.startswith("--no-") else True
        elif meta["repeat"]:
            kw.update(action="append", metavar=meta["metavar"])
        else:
            kw.update(
                type=_base_type(get_args(tp)[0]) if get_origin(tp) is tuple else tp,
                metavar=meta["metavar"],
                choices=meta["choices"],
            )
        group.add_argument(flag, **kw)


def overrides_from_args(args: Any, cls: type) -> dict[str, Any]:
    """The flags of `cls` that were given, as field overrides."""
    out = {}
    for f in fields(cls):
        if "help" in f.metadata and getattr(args, f.name, None) is not None:
            v = getattr(args, f.name)
            out[f.name] = tuple(v) if f.metadata["repeat"] else v
    return out
