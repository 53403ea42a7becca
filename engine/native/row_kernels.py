"""Which kernels a step's rows take: the native few-row kernels, or torch's.

Both compute a row the same way however many rows share the call (the native kernels up to
MAX_ROWS, torch's at any count), but not the same way as each other: their sums run in other
orders, so in bf16 a result can round the other way. If the choice followed the step's row count,
a request's prompt would be computed one way alone (10 rows: native) and another way packed with
seven others (80 rows: torch), and a greedy output could change with what it was batched with.
So the choice follows the kind of the request's rows instead:

- decode and verification rows (a step of at most a few rows per request) take the native kernels;
- prompt rows, and every row of an evaluation forward, take torch's.

The runner sets this around each forward (engine/worker/runner.py); the default, for code that runs
outside a runner step (checks, benchmarks of one kernel), is the native kernels where they apply.
A context variable, not a module flag: the scheduler thread sets it for its own forward, and the
transfer threads it starts never read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_FEW_ROW_NATIVE: ContextVar[bool] = ContextVar("few_row_native", default=True)


@contextmanager
def few_row_kernels(native: bool) -> Iterator[None]:
    """Within the block, few-row ops take the native kernels (native=True) or torch's (False)."""
    token = _FEW_ROW_NATIVE.set(native)
    try:
        yield
    finally:
        _FEW_ROW_NATIVE.reset(token)


def native_rows_allowed() -> bool:
    """Whether the current step's few-row ops may take the native kernels."""
    return _FEW_ROW_NATIVE.get()
