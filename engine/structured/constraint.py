"""TokenConstraint: the per-request grammar state that masks the next token.

The runner calls, per sampled position:

    mask = c.allowed()        # [V] bool: tokens the grammar permits next
    ...sample with logits[~mask] = -inf...
    c.advance(token)          # the token is committed

and, after a rejected speculative window, `c.rollback(n)` undoes the last n advances so the
grammar state follows the KV cache back.  Once the grammar is complete only the end-of-sequence
tokens are allowed, so the sequence ends as "stop" through the ordinary EOS path.

The implementation uses llguidance (Rust, CPU wheels on PyPI): it compiles JSON schemas lazily
and computes a mask in microseconds per token, and it supports rollback natively.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from engine.structured.spec import ConstraintSpec

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (no free whitespace): a sampling model cannot wander through unbounded runs of
# spaces and newlines, and the output matches what OpenAI's structured outputs return.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class TokenConstraint(ABC):
    """Grammar state of one sequence. Not thread-safe; owned by the runner like a KV cache."""

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """[V] bool mask of the tokens allowed next (does not change the state)."""

    @abstractmethod
    def advance(self, token_id: int) -> None:
        """Commit a sampled token. Raises ValueError if the grammar forbids it."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n advances (speculative rejection)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar accepted an end-of-sequence token: nothing more may follow."""


class GrammarCompiler:
    """Holds the tokenizer's llguidance view (about 1 s to build for a real vocabulary), so build
    one per engine and call `make` per request."""

    def __init__(
        self, tokenizer: Any, vocab_size: int | None = None, eos_ids: list[int] | None = None
    ) -> None:
        import llguidance.hf

        self.vocab_size = int(vocab_size or len(tokenizer))
        eos = list(eos_ids) if eos_ids else None
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)

    def make(self, spec: ConstraintSpec) -> LLGuidanceConstraint:
        import llguidance

        # Ignored: llguidance takes a boolean schema too; its stub says str | dict only.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            spec.schema_value(),  # type: ignore[arg-type]
            overrides=_JSON_OPTIONS,
        )
        matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {matcher.get_error()}")
        return LLGuidanceConstraint(matcher, self.vocab_size)


def check_spec(spec: ConstraintSpec) -> str | None:
    """Front-end validation without a tokenizer: an error message, or None if the schema compiles."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            spec.schema_value(),  # type: ignore[arg-type]  # a bool schema: as make()
            overrides=_JSON_OPTIONS,
        )
    except (ValueError, TypeError) as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(grammar) or None


class LLGuidanceConstraint(TokenConstraint):
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.n_advanced = 0

    def allowed(self) -> torch.Tensor:
        # One byte per token: 0 (forbidden) or 200 (allowed). [V]
        bias = self.matcher.compute_logit_bias()
        mask = torch.frombuffer(bytearray(bias), dtype=torch.uint8) > 0
        if mask.shape[0] < self.vocab_size:  # the model's logits may be padded past the tokenizer
            mask = torch.cat([mask, torch.zeros(self.vocab_size - mask.shape[0], dtype=torch.bool)])
        return mask[: self.vocab_size]

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(int(token_id)):
            raise ValueError(f"token {token_id} violates the grammar: {self.matcher.get_error()}")
        self.n_advanced += 1

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.n_advanced:
            raise ValueError(f"cannot roll back {n} of {self.n_advanced} tokens")
        if n and not self.matcher.rollback(n):
            raise ValueError(f"grammar rollback failed: {self.matcher.get_error()}")
        self.n_advanced -= n

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


def make_constraint(
    spec: ConstraintSpec,
    tokenizer: Any,
    vocab_size: int | None = None,
    eos_ids: list[int] | None = None,
) -> TokenConstraint:
    """One-off convenience; engines should keep a GrammarCompiler and call `make`."""
    return GrammarCompiler(tokenizer, vocab_size, eos_ids).make(spec)
