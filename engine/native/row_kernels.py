"""Which kernels a step's rows take: the native kernels, or torch's.

Every row of every step takes the native kernels where they apply (engine/native/): a decode row,
a verification window's rows, a prompt's rows and an evaluation forward's rows. Each native kernel
computes a row the same way whatever other rows share the call (its sums run in one order per row;
attention.c `attention_rows` attends each row to its keys in one order), so a request's tokens
and logprobs do not depend on speculation, batching, prefill chunking or a prefix-cache hit.
torch's kernels do not promise that: their many-row and one-row paths sum in other orders, so in
bf16 a row can round the other way with other rows beside it.

`native_rows(False)` runs a block on torch's kernels instead: tests and benchmarks that compare
the two families. A context variable, not a module flag: a thread that sets it changes only its own
forwards, and the transfer threads a step starts never read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_NATIVE_ROWS: ContextVar[bool] = ContextVar("native_rows", default=True)


@contextmanager
def native_rows(native: bool) -> Iterator[None]:
    """Within the block, rows take the native kernels where they apply (native=True) or torch's (False)."""
    token = _NATIVE_ROWS.set(native)
    try:
        yield
    finally:
        _NATIVE_ROWS.reset(token)


def native_rows_allowed() -> bool:
    """Whether the current step's rows may take the native kernels."""
    return _NATIVE_ROWS.get()
