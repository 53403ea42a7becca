"""The --expert-read-faults spec (EngineConfig.expert_read_faults): which faults engine/experts/tiers/read_faults.py
injects into the slow tier's expert reads, and when. Parsed here, below the engine's packages, so the
config checks it at start (as engine/link_spec.py does for --link). The grammar is in read_faults.py."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

KINDS = ("eio", "short", "delay")
_KEYS = {"p": float, "every": int, "period": float, "after": int, "secs": float, "seed": int}


@dataclass(frozen=True)
class FaultRule:
    """One fault of the spec: its kind and when it fires (exactly one of p, every, period)."""

    kind: str
    p: float = 0.0
    every: int = 0
    period: float = 0.0
    after: int = 0
    secs: float = 2.0
    seed: int = 0


def parse_read_faults(spec: str) -> tuple[FaultRule, ...]:
    """The rules of a --expert-read-faults spec; a ConfigError names what is wrong with it."""
    rules = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(
                f"--expert-read-faults: unknown fault {kind!r}; use {', '.join(KINDS)}"
            )
        values: dict[str, float | int] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in _KEYS:
                raise ConfigError(
                    f"--expert-read-faults: unknown key {key!r} in {item!r}; use {', '.join(_KEYS)}"
                )
            try:
                values[key] = _KEYS[key](value)
            except ValueError:
                raise ConfigError(
                    f"--expert-read-faults: {key}={value!r} is not a number"
                ) from None
        rule = FaultRule(kind, **values)  # type: ignore[arg-type]  # keys checked against _KEYS
        if sum(bool(x) for x in (rule.p, rule.every, rule.period)) != 1:
            raise ConfigError(f"--expert-read-faults: {item!r} needs one of p=, every= or period=")
        if not 0.0 <= rule.p <= 1.0 or rule.every < 0 or rule.period < 0 or rule.after < 0:
            raise ConfigError(f"--expert-read-faults: {item!r}: p in [0, 1], counts and times >= 0")
        if rule.secs < 0:
            raise ConfigError(f"--expert-read-faults: {item!r}: secs must be >= 0")
        rules.append(rule)
    if not rules:
        raise ConfigError("--expert-read-faults: no fault named")
    return tuple(rules)
