"""Grammar-constrained decoding: one small TokenConstraint object per request (see constraint.py)."""

from engine.structured.constraint import GrammarCompiler, TokenConstraint, make_constraint
from engine.structured.spec import ConstraintSpec

__all__ = ["ConstraintSpec", "GrammarCompiler", "TokenConstraint", "make_constraint"]
