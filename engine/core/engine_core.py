"""The engine core: one `step()` that every client drives.

    plan = scheduler.schedule()            # which windows run (no tensors)
    plan = proposer.propose(plan)          # optional: append proposed tokens to decode windows
    out = runner.execute(plan)             # one packed forward; sample or verify; crop KV caches
    observers see (plan, out)              # acceptance statistics, the speculative sensor
    return scheduler.update(plan, out)     # advance by what was kept; stops; detokenize; free

The server's engine process runs it behind a process boundary (engine/core/engine_process.py);
`moe-offload generate` and the benchmarks run it in-process through `generate()`.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.messages import GenerateRequest, RequestOutput
from engine.core.scheduler import Scheduler, StepOutput, StepPlan


class StepObserver(Protocol):
    """Sees each step's plan and results after execution (acceptance, the speculative sensor)."""

    def observe(self, plan: StepPlan, out: StepOutput) -> None: ...


class Proposer(StepObserver, Protocol):
    """Fills decode windows with proposed tokens (speculative decoding). It may use at most
    `SeqWork.max_draft` tokens per request and returns a new plan (SeqWork is frozen)."""

    def propose(self, plan: StepPlan) -> StepPlan: ...


@dataclass(frozen=True)
class CoreLimits:
    max_running: int = 64  # sequences decoded together in one step
    prefill_token_budget: int = 1024  # prompt tokens prefilled per step (longer prompts are chunked)
    max_model_len: int = 2048  # prompt + output tokens


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Any, proposer: Proposer | None = None,
                 observers: tuple[StepObserver, ...] = ()) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer
        self.observers = ((proposer,) if proposer is not None else ()) + tuple(observers)

    @classmethod
    def for_model(cls, lm: Any, limits: CoreLimits = CoreLimits(), proposer: Proposer | None = None,
                  observers: tuple[StepObserver, ...] = ()) -> EngineCore:
        from engine.worker.runner import ModelRunner  # tensors live in worker/, not here

        runner = ModelRunner(lm)
        sched = Scheduler(lm.tokenizer, lm.eos_token_ids, limits.max_running, limits.prefill_token_budget, limits.max_model_len, runner.prefix)
        # The model's own observers (the sensor feeding the utility estimator) run in every core.
        observers = tuple(observers) + tuple(o for o in getattr(lm, "step_observers", ()) if o not in observers)
        return cls(sched, runner, proposer, observers)

    # -- inputs ----------------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> None:
        self.scheduler.add(req)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        return self.scheduler.abort(request_id, reason, error)

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
        return self.scheduler.abort_all(reason, error)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if self.proposer is not None:
            plan = self.proposer.propose(plan)
        out = self.runner.execute(plan)
        for obs in self.observers:
            obs.observe(plan, out)
        return self.scheduler.update(plan, out)

    def generate(self, reqs: list[GenerateRequest]) -> Iterator[RequestOutput]:
        """Run requests to completion in-process, yielding outputs as they come."""
        for r in reqs:
            self.add(r)
        while self.has_work():
            yield from self.step()
