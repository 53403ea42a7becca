"""Which path a step takes: resolved once at load into a plan, then asked per step, and counted.

The plan (`ExecutionPlan`) is what this model on this device can run, chosen from EngineConfig's
`forward`, `native_kernels` and `decode_attention` and from what the model is: the best forward
(fused native layers, the lean layer-by-layer forward, or transformers' own), the decode attention,
the expert path and the router, each with the reason for it and for every path declined. `serve` and
`generate` log it once at start.

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
from typing import Any

from engine.errors import ConfigError
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


@dataclass(frozen=True)
class Choice:
    """One resolved capability: what runs and why (and what was declined, in `why`)."""

    what: str
    chosen: str
    why: str


@dataclass(frozen=True)
class ExecutionPlan:
    forward: str  # "fused" (and lean for the steps it declines), "lean" or "transformers"
    native_attention: bool  # a decode row's attention in one native call (else SDPA)
    choices: tuple[Choice, ...]

    def lines(self) -> list[str]:
        width = max(len(c.what) for c in self.choices)
        return [f"{c.what:<{width}}  {c.chosen}: {c.why}" for c in self.choices]

    def with_choice(self, what: str, chosen: str, why: str) -> ExecutionPlan:
        """The plan with one more line (speculation, resolved by the front end)."""
        return ExecutionPlan(
            self.forward, self.native_attention, self.choices + (Choice(what, chosen, why),)
        )

    def with_speculation(self, mode: str, why: str) -> ExecutionPlan:
        """The plan with its speculation line. Where the native kernels are off, greedy speculation is not
        bit-exact, and the line says so: torch's matmuls compute a row differently with more rows beside
        it (f32 on the CPU: a window of 2-3 rows against one; a GPU's kernels likewise), so a verification
        window's rows can round unlike plain decode rows. The native kernels compute each row alike."""
        native = self.to_dict().get("native kernels", {}).get("chosen") == "on"
        if mode != "off" and not native:
            why += (
                "; not bit-exact here: with torch's kernels a verification window's rows can round unlike"
                " single decode rows, so greedy tokens may differ from plain decoding"
            )
        return self.with_choice("speculation", mode, why)

    def to_dict(self) -> dict[str, Any]:
        return {c.what: {"chosen": c.chosen, "why": c.why} for c in self.choices}


def dense_weights(mode: str, native: bool) -> tuple[str, str]:
    """The plan's line for --dense-quant: what the dense linears hold and which kernel multiplies them."""
    if mode == "none":
        return "none", "attention, dense MLPs and lm_head in the compute dtype (--dense-quant none)"
    how = (
        "the native int8 gemv for decode and verification rows, torch for prompt rows"
        if native
        else "torch (x q^T) * s: the native kernels are off"
    )
    return (
        mode,
        f"attention, dense and shared-expert MLPs and lm_head int8 per output channel; {how}",
    )


def exactness(forward: str, native: bool, native_attention: bool) -> tuple[str, str]:
    """The plan's line for the numeric family: whether each row computes the same bits whatever shares
    its step (batch-invariant), and why not where it does not."""
    if forward == "transformers":
        return (
            "not batch-invariant",
            "transformers' forward: torch's attention and matmuls round a row by what shares the call",
        )
    if not native:
        return (
            "not batch-invariant",
            "torch's kernels (--native-kernels off or unavailable) round a row by what shares the call",
        )
    if not native_attention:
        return "not batch-invariant", "torch's SDPA for attention (--decode-attention sdpa)"
    return (
        "batch-invariant",
        "every row through the native kernels: tokens and logprobs do not depend on batching,"
        " speculation, prefill chunking, prefix-cache hits or residency",
    )


def resolve_plan(
    cfg: Any, *, lean_ok: str | None, kernels: str, on_cpu: bool, complete: bool, router: str
) -> ExecutionPlan:
    """The plan for EngineConfig `cfg`. lean_ok: None where the lean forward supports the model, else why
    not; kernels: the native kernels' line ("on: ..." or "off: why"); on_cpu: the compute device is the CPU;
    complete: every routed expert fits the fast tier; router: the router line. Raises ConfigError, in one
    line, for a path asked for that cannot run."""
    native = kernels.startswith("on")
    if cfg.forward in ("fused", "lean") and lean_ok is not None:
        raise ConfigError(f"--forward {cfg.forward}: {lean_ok}; use --forward auto or transformers")
    if cfg.decode_attention == "native" and not (native and on_cpu):
        raise ConfigError(
            "--decode-attention native needs the native CPU kernels on a CPU; use auto or sdpa"
        )
    if cfg.forward == "fused" and not (native and on_cpu):
        raise ConfigError("--forward fused needs the native CPU kernels on a CPU; use auto or lean")
    native_attention = native and on_cpu and cfg.decode_attention != "sdpa"
    if cfg.forward == "transformers":
        forward, why = "transformers", "--forward transformers"
    elif lean_ok is not None:
        forward, why = "transformers", f"lean forward declined: {lean_ok}"
    elif cfg.forward == "lean":
        forward, why = "lean", "--forward lean"
    elif not native_attention:
        forward, why = (
            "lean",
            "fused step declined: "
            + (
                "the native attention off (--decode-attention sdpa)"
                if native and on_cpu
                else "needs the native CPU kernels on a CPU"
            ),
        )
    else:
        forward, why = (
            "fused",
            (
                f"one native call a layer for steps of up to {MAX_FUSED_ROWS} rows after cached positions (decode rows"
                " of a batch, verification windows) whose experts are all resident; the others layer by layer"
            ),
        )
    if forward == "fused" and not complete:
        why += " (the fast tier holds fewer than all routed experts: most steps can miss, and go layer by layer)"
    attention = (
        "native" if native_attention else "sdpa",
        "one call a request for all its rows (decode, window, prompt), each as a decode row alone"
        if native_attention
        else ("--decode-attention sdpa" if cfg.decode_attention == "sdpa" else kernels),
    )
    if forward == "transformers":
        attention = ("transformers", "the model's own attention")
    experts = (
        ("resident lane", "every routed expert resident: no planning per layer")
        if complete and cfg.cpu_experts == "off" and cfg.resident_lane
        else ("planned", "--no-resident-lane: every step through the per-layer plan")
        if complete and cfg.cpu_experts == "off"
        else ("cpu split", f"--cpu-experts {cfg.cpu_experts}: misses may run on CPU workers")
        if cfg.cpu_experts != "off"
        else (
            "streaming",
            f"a fast tier of part of the experts ({cfg.offload} slow tier, --policy {cfg.policy})",
        )
    )
    choices = (
        Choice("forward", forward, why),
        Choice("exactness", *exactness(forward, native and on_cpu, native_attention)),
        Choice("attention", *attention),
        Choice("experts", *experts),
        Choice("router", *router.split(": ", 1)),
        Choice("native kernels", *kernels.split(": ", 1)),
        Choice("dense weights", *dense_weights(cfg.dense_quant, native and on_cpu)),
    )
    return ExecutionPlan(forward, native_attention and forward != "transformers", choices)
