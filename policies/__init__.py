"""Pure decision objects: they see expert ids, gate weights and cache state, never tensors."""

from policies.base import (
    DROPPED,
    AdmissionPolicy,
    EvictionPolicy,
    ExpertPlan,
    MissPolicy,
    SubstituteChoice,
)
from policies.registry import (
    POLICY_NAMES,
    PolicyBundle,
    make_admission,
    make_eviction,
    make_miss_policy,
    make_policies,
)

__all__ = [
    "DROPPED",
    "AdmissionPolicy",
    "EvictionPolicy",
    "ExpertPlan",
    "MissPolicy",
    "SubstituteChoice",
    "POLICY_NAMES",
    "PolicyBundle",
    "make_admission",
    "make_eviction",
    "make_miss_policy",
    "make_policies",
]
