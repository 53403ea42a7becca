"""The contracts between the engine core and the packages above it (engine/worker/, engine/speculative/).

The core drives a step with plain data (engine/core/scheduler.py) and sees the tensor side only
through these Protocols, so it imports neither package (the layering contracts in .importlinter
enforce it):

- `ModelForward`: one pass of a model over every request's window. Implemented by
  ModelRunner.forward (engine/worker/runner.py; the draft's too, engine/speculative/draft.py),
  and, with their model and device bound,
  packed_forward / one_by_one_forward (engine/worker/packed_batch.py) and LeanForward
  (engine/worker/lean_forward.py).
- `Runner`: executes a StepPlan (ModelRunner).
- `RunnableModel`: a loaded model that makes its Runner (LoadedModel, engine/worker/loaded_model.py),
  which is how EngineCore.for_model builds a core without importing the worker. The loaded model
  is data: the loader (engine/worker/loader.py) names the runner class it is run by, so neither
  the data nor the core imports the runner (tests/test_import_cycles.py: no import circle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from engine.core.kv_blocks import KVBlocks
    from engine.core.step_types import StepOutput, StepPlan


class ModelForward(Protocol):
    """`forward(windows, starts, caches, keep) -> logits`.

    windows[r]: the token ids request r runs this step (a prefill chunk, one decode token, or a
    verification window of k+1); starts[r]: the position of its first token; caches[r]: its KV
    cache, which holds exactly starts[r] positions on entry and is appended to in place; keep[r]:
    the rows of window r whose logits are wanted. Returns one [len(keep[r]), V] tensor per request.
    Every window runs in one pass where the model allows (the rows of a step share each MoE layer).
    """

    def __call__(
        self, windows: list[list[int]], starts: list[int], caches: list[Any], keep: list[list[int]]
    ) -> list[Tensor]: ...


class Runner(Protocol):
    """Runs a step's plan on the model: one forward over every window, then sampling (or
    verification of proposals), KV caches cropped to what was kept. Owns every request's tensors
    (KV cache, RNG); drops those of plan.free_ids. Called once per step, on the scheduler thread."""

    def execute(self, plan: StepPlan) -> StepOutput: ...


class RunnableModel(Protocol):
    """A loaded model as the core needs it: a tokenizer for detokenizing, its end-of-sequence
    ids, the step observers it brings (the speculative sensor), and a runner for its steps."""

    tokenizer: Any

    @property
    def eos_token_ids(self) -> set[int]: ...

    def make_runner(self) -> Runner: ...


class MemorySplitter(Protocol):
    """Moves memory between the KV pool and the experts' fast tier between steps (MemorySplit,
    engine/memory/split.py): `demand_blocks` are the blocks running requests hold and waiting ones want,
    `idle` says nothing runs or waits. It grows or shrinks `blocks` itself."""

    def rebalance(self, blocks: KVBlocks, demand_blocks: int, idle: bool) -> None: ...
