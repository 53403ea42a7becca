"""The execution plan: which paths this model's steps may take, resolved once before the load (with the
rest of the load's decisions: engine/plan/resolve.py) and logged at start.

The plan (`ExecutionPlan`) is what this model on this device can run, chosen from EngineConfig's
`forward`, `native_kernels` and `decode_attention` and from what the model is: the best forward
(fused native layers, the lean layer-by-layer forward, or transformers' own), the decode attention,
the expert path and the router, each with the reason for it and for every path declined; then the
experts' kernel and the prefetchers. Per step, engine/worker/dispatch.py says which of them a step takes.
Plain data and strings: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.native.limits import MAX_ROWS  # rows of one fused step (engine/native/decode_layer.c)


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
                f"one native call a layer for steps of up to {MAX_ROWS} rows after cached positions (decode rows"
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
    experts = experts_choice(cfg, complete)
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


def experts_choice(cfg: Any, complete: bool) -> tuple[str, str]:
    """The plan's line for how a step's routed experts run: `complete`, every routed expert in the fast
    tier (nothing can miss, whatever plans around misses is attached)."""
    return (
        (
            "resident lane",
            "every routed expert resident: no planning per layer"
            + (
                f" (--cpu-experts {cfg.cpu_experts} and the utility estimator see no miss)"
                if cfg.cpu_experts != "off"
                else ""
            ),
        )
        if complete and cfg.resident_lane
        else ("planned", "--no-resident-lane: every step through the per-layer plan")
        if complete
        else ("cpu split", f"--cpu-experts {cfg.cpu_experts}: misses may run on CPU workers")
        if cfg.cpu_experts != "off"
        else (
            "streaming",
            f"a fast tier of part of the experts ({cfg.offload} slow tier, --policy {cfg.policy})",
        )
    )


def lean_declined(model_type: str, packed: bool, structure: bool) -> str | None:
    """Why the lean forward cannot run this model (None: it can): `packed`, the architecture's attention
    takes packed windows (engine/worker/packed_batch.py); `structure`, its layers are the lean forward's
    (engine/worker/lean_forward.py `LeanForward.supports`)."""
    if not packed:
        return f"{model_type} runs one forward per request (no packed attention)"
    if not structure:
        return f"{model_type} is not among the lean forward's architectures"
    return None


def router_line(on_cpu: bool, kernels: str) -> str:
    """The plan's router line: the native softmax top-k on the CPU with the kernels on, else the module's."""
    return (
        "native: softmax top-k routers in C once their first call matches the module's (others: the module's own)"
        if on_cpu and kernels.startswith("on")
        else "module: the model's own router"
    )


def expert_kernel(fmt: str, native: str | None, kernels_on: bool) -> tuple[str, str]:
    """The plan's line for what multiplies a decode row's routed experts (engine/experts/compute/expert_compute.py):
    `native`, the native path's name for `fmt`'s slots, or None where torch runs them."""
    if native is not None:
        return native, f"{fmt} slots, every row: decode, verification and prompt"
    why = "no native kernel reads these slots" if kernels_on else "the native kernels are off"
    return "torch", f"{fmt} slots through the format's torch path ({why})"


def prefetch_choice(
    cfg: Any, running: tuple[str, ...], complete: bool, on_cpu: bool
) -> tuple[str, str]:
    """The plan's prefetch line: the prefetchers that run (`running`) and why."""
    if cfg.prefetch != "auto":
        why = f"--prefetch {cfg.prefetch}"
    elif running:
        why = "auto: a partial fast tier, a SpecPrefetch adapter beside the model, and a substituting policy or a GPU"
    elif complete:
        why = "auto: every routed expert is resident, nothing to prefetch"
    else:
        why = (
            (
                "auto: on a CPU with an exact policy the adapter measured slower than none (docs/benchmarks/policies.md);"
                " or no adapter file"
            )
            if on_cpu
            else "auto: no SpecPrefetch adapter file beside the model"
        )
    return ",".join(running) or "none", why
