"""Pure decision objects: they see expert ids, gate weights and cache state, never tensors."""
from policies.base import EvictionPolicy, ExpertPlan, MissPolicy
from policies.registry import make_eviction, make_miss_policy

__all__ = ["EvictionPolicy", "ExpertPlan", "MissPolicy", "make_eviction", "make_miss_policy"]
