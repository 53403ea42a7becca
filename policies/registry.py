"""Policies are chosen by name from config files and the command line.

A *policy name* picks a miss rule and, for the presets, the eviction and admission that
go with it; an explicit eviction or admission name overrides the preset's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.admission import BackgroundAdmission, NoAdmission
from policies.base import AdmissionPolicy, EvictionPolicy, MissPolicy, SubstituteChoice
from policies.frequency import FrequencyEviction
from policies.lru import LRUEviction
from policies.miss import FetchAll, FirstChoicePolicy, ThresholdPolicy
from policies.reuse_distance import ReuseDistanceEviction
from policies.substitute import BestResident, DropRenormalize
from policies.utility import UtilityEviction

MISS_RULES = ("fetch-all", "threshold", "first-choice", "threshold-noprotect")
# preset -> (miss rule, default eviction, default admission)
PRESETS: dict[str, tuple[str, str, str]] = {
    "quality-first": ("threshold", "frequency", "background"),
    "speed-first": ("first-choice", "frequency", "background"),
}
POLICY_NAMES = MISS_RULES + tuple(PRESETS)
EVICTIONS = ("lru", "frequency", "utility", "reuse")
ADMISSIONS = ("none", "background")
SUBSTITUTES = ("best-resident", "drop")


@dataclass(frozen=True)
class PolicyBundle:
    miss: MissPolicy
    eviction: EvictionPolicy
    admission: AdmissionPolicy


def _pick(kind: str, name: str, choices: tuple[str, ...]) -> str:
    if name not in choices:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(choices)}")
    return name


def make_substitute(name: str) -> SubstituteChoice:
    return (
        BestResident()
        if _pick("substitute choice", name, SUBSTITUTES) == "best-resident"
        else DropRenormalize()
    )


def make_miss_policy(
    name: str, substitute: str = "best-resident", threshold: float = 0.15
) -> MissPolicy:
    rule = PRESETS[name][0] if name in PRESETS else _pick("miss policy", name, POLICY_NAMES)
    if rule == "fetch-all":
        return FetchAll()
    if rule in ("threshold", "threshold-noprotect"):
        return ThresholdPolicy(
            make_substitute(substitute), threshold, protect_first=rule == "threshold"
        )
    return FirstChoicePolicy(make_substitute(substitute))


def make_eviction(name: str, decay: float = 0.999) -> EvictionPolicy:
    name = _pick("eviction policy", name, EVICTIONS)
    if name == "utility":
        return UtilityEviction()  # the loader binds it to the model's utility estimator
    if name == "reuse":
        return ReuseDistanceEviction()  # the loader binds it to the model's MoE layer order
    return LRUEviction() if name == "lru" else FrequencyEviction(decay)


def make_admission(name: str, beta: float = 0.5) -> AdmissionPolicy:
    return (
        NoAdmission()
        if _pick("admission policy", name, ADMISSIONS) == "none"
        else BackgroundAdmission(beta)
    )


def make_policies(
    policy: str,
    eviction: str | None = None,
    admission: str | None = None,
    substitute: str = "best-resident",
    threshold: float = 0.15,
    beta: float = 0.5,
    decay: float = 0.999,
) -> PolicyBundle:
    """Build the miss, eviction and admission policies; None means the preset's (or plain) default."""
    _pick("miss policy", policy, POLICY_NAMES)
    # Plain policies evict by predicted reuse distance: as good as LRU for one stream, and it
    # does not thrash when concurrent streams need more experts a step than the tier holds.
    default_evict, default_admit = PRESETS[policy][1:] if policy in PRESETS else ("reuse", "none")
    return PolicyBundle(
        miss=make_miss_policy(policy, substitute, threshold),
        eviction=make_eviction(eviction or default_evict, decay),
        admission=make_admission(admission or default_admit, beta),
    )
