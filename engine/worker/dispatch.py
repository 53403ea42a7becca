"""Which path a step takes: asked per step, and counted.

The plan of what this model on this device can run (`ExecutionPlan`: forward, decode attention, expert
path, router, each with its reason) is resolved once before the load, with the rest of the load's
decisions (engine/plan/execution.py); `serve` and `generate` log it once at start.

Per step, `fused_decline` is the one place that says whether a step can take the fused path given its
shape (`StepShape`): the requests and their rows (a decode row each, or a verification window),
whether a request starts a prompt, whether every expert it can need is resident, and whether a routing
listener must see each layer live. The fused step itself may still
decline for what only it knows (its first-call checks not run yet, the cache past the native
attention's range). Every forward's path and every decline's reason is counted in EngineStats, so
`generate --json` and /metrics say which path each step took.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.native.limits import MAX_ROWS

MAX_FUSED_ROWS = MAX_ROWS  # rows of one fused step (engine/native/decode_layer.c)

# Why a step did not take the fused path: a fixed vocabulary (they are metric labels).
TOO_MANY_ROWS = f"more than {MAX_FUSED_ROWS} rows"  # a long prefill chunk, or many requests at once
PROMPT_START = (
    "a prompt's first rows"  # a request with nothing cached yet: its prompt goes layer by layer
)
EXPERTS_CAN_MISS = "experts can miss"  # a partial fast tier, or the tier still filling
EXPERTS_PLANNED = (
    "experts planned per layer"  # CPU-run experts or the utility estimator plan each layer
)
LIVE_LISTENER = (
    "live routing listener"  # a predictor that must see each layer before its experts run
)
TIMED_BLOCK = "a timed MoE block"  # a benchmark times each block's calls (OffloadedMoeBlock.timers)
CHECKS_PENDING = (
    "first-call checks pending"  # the native norms and routers have not been checked yet
)
OUT_OF_RANGE = "past the native attention range"
LAYER_UNSUPPORTED = "a layer it cannot run"  # for good: the plan's log line says which and why
NOT_PLANNED = "not in the plan"  # --forward lean, or the native attention off


@dataclass(frozen=True)
class StepShape:
    """What decides a decode step's path, as plain data."""

    rows: tuple[int, ...]  # rows of each request's window
    prompt_start: bool  # some request has nothing cached yet (its prompt's first chunk)
    all_resident: bool  # every routed expert resident for good, nothing planned around misses
    planned_per_layer: bool  # CPU-run experts or the utility estimator plan each MoE layer
    live_listener: bool  # a routing listener must see each layer before its experts run
    timed: bool  # a benchmark times the MoE blocks' calls


def fused_decline(shape: StepShape) -> str | None:
    """Why this step cannot take the fused path (one of the reasons above), or None where it can."""
    if sum(shape.rows) > MAX_FUSED_ROWS:
        return TOO_MANY_ROWS
    if shape.prompt_start:
        return PROMPT_START
    if shape.planned_per_layer:
        return EXPERTS_PLANNED
    if not shape.all_resident:
        return EXPERTS_CAN_MISS
    if shape.live_listener:
        return LIVE_LISTENER
    if shape.timed:
        return TIMED_BLOCK
    return None
