"""The engine core: one `step()` that every client drives.

    plan = scheduler.schedule()            # which windows run (no tensors)
    plan = proposer.propose(plan)          # optional: append proposed tokens to decode windows
    out = runner.execute(plan)             # one packed forward; sample or verify; crop KV caches
    observers see (plan, out)              # acceptance statistics, the speculative sensor
    return scheduler.update(plan, out)     # advance by what was kept; stops; detokenize; free

Faults stay with their request (engine/core/faults.py): a proposer that fails on a window, or
a detokenizer that fails on a token, ends that request with an error and the step goes on;
the runner does the same for the forward and sampling. A failing observer only loses its
statistics. What escapes `step()` is the engine's own fault.

The server's engine process runs it behind a process boundary (engine/launch.py builds it,
engine/core/engine_process.py runs its loop); `moe-offload generate` and the benchmarks run it
in-process through `generate()`. The runner and the model are seen through engine/core/contracts.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol

from engine.core.contracts import MemorySplitter, RunnableModel, Runner
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.faults import log, request_fault
from engine.core.kv_blocks import BLOCK_TOKENS, KVBlocks, pool_blocks
from engine.core.kv_demand import KvDemand
from engine.core.limits import CoreLimits
from engine.core.messages import GenerateRequest, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step_types import SeqState, StepOutput, StepPlan


class StepObserver(Protocol):
    """Sees each step's plan and results after execution (acceptance, the speculative sensor)."""

    def observe(self, plan: StepPlan, out: StepOutput) -> None: ...


class Proposer(StepObserver, Protocol):
    """Fills decode windows with proposed tokens (speculative decoding). It may use at most
    `SeqWork.max_draft` tokens per request and returns a new plan (SeqWork is frozen)."""

    def propose(self, plan: StepPlan) -> StepPlan: ...


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        proposer: Proposer | None = None,
        observers: tuple[StepObserver, ...] = (),
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer
        self.observers = ((proposer,) if proposer is not None else ()) + tuple(observers)
        # The KV/expert split (engine/memory/split.py), where the runner's paged pool has one.
        self.split: MemorySplitter | None = getattr(getattr(runner, "pool", None), "split", None)
        self._demand = KvDemand()
        self._local_ids = itertools.count()  # local_request's names: unique within this core
        self._rebalance()  # idle: moves nothing, shows the split on /metrics from the start

    @classmethod
    def for_model(
        cls,
        lm: RunnableModel,
        limits: CoreLimits = CoreLimits(),
        proposer: Proposer | None = None,
        observers: tuple[StepObserver, ...] = (),
    ) -> EngineCore:
        """A core for a loaded model: its own runner (lm.make_runner(); the tensors live in worker/), whose prefix
        cache (if any) the scheduler consults when it admits a request."""
        runner = lm.make_runner()
        lookahead = getattr(getattr(proposer, "k", None), "k_max", 0)
        blocks = kv_blocks_for(
            runner, getattr(lm, "kv_token_budget", None), limits.max_model_len + lookahead
        )
        sched = Scheduler(
            lm.tokenizer,
            lm.eos_token_ids,
            limits.max_running,
            prefill_token_budget=limits.prefill_token_budget,
            max_model_len=limits.max_model_len,
            prefix=getattr(runner, "prefix", None),
            blocks=blocks,
            lookahead=lookahead,
        )
        # The model's own observers (the sensor feeding the utility estimator) run in every core.
        observers = tuple(observers) + tuple(
            o for o in getattr(lm, "step_observers", ()) if o not in observers
        )
        return cls(sched, runner, proposer, observers)

    # -- inputs ----------------------------------------------------------------------------
    def local_request(
        self, prompt_ids: list[int], params: SamplingParams, **kw: Any
    ) -> GenerateRequest:
        """A request made in this process (`generate`, benchmarks, tests), named local-0, local-1, ...
        in the order this core made them; `kw`: GenerateRequest's other fields. Not added yet."""
        return GenerateRequest(f"local-{next(self._local_ids)}", list(prompt_ids), params, **kw)

    def add(self, req: GenerateRequest) -> None:
        self.scheduler.add(req)

    def abort(
        self, request_id: str, reason: str = "abort", error: str | None = None
    ) -> RequestOutput | None:
        return self.scheduler.abort(request_id, reason, error)

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
        return self.scheduler.abort_all(reason, error)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._rebalance()
        plan = self.scheduler.schedule()
        failed: list[RequestOutput] = []
        if self.proposer is not None:
            plan = self._propose(plan, failed)
        out = self.runner.execute(plan)
        for obs in self.observers:
            try:
                obs.observe(plan, out)
            except Exception:  # noqa: BLE001 - statistics are not worth a request
                log.exception(
                    "step observer %s failed; the step's tokens stand", type(obs).__name__
                )
        outputs = failed + self._update(plan, out)
        if not self.scheduler.has_work():
            self._rebalance()  # idle now: the experts take back what the KV pool borrowed
        self._publish_kv()
        return outputs

    def _rebalance(self) -> None:
        """Let the KV/expert split move memory, between steps, by the KV blocks the requests hold and want."""
        blocks = self.scheduler.blocks
        if self.split is not None and blocks is not None:
            sched = self.scheduler
            demand = self._demand(blocks, len(sched.running), sched.waiting, sched.max_running)
            self.split.rebalance(blocks, demand, not sched.has_work())

    def _publish_kv(self) -> None:
        """The KV pool's blocks and the preemptions so far, to the model's stats (/metrics)."""
        blocks = self.scheduler.blocks
        stats = getattr(getattr(self.runner, "lm", None), "stats", None)
        if blocks is None or stats is None or not hasattr(stats, "set_kv_pool"):
            return
        pool, counts = getattr(self.runner, "pool", None), blocks.counts()
        stats.set_kv_pool(counts, self.scheduler.preemptions, getattr(pool, "bytes_per_block", 0))
        if pool is not None:  # the pool's cached blocks are the prefix cache
            stats.set_prefix_cache(
                blocks.hit_tokens,
                blocks.query_tokens,
                counts.cached * pool.bytes_per_block,
                counts.cached,
            )

    def _propose(self, plan: StepPlan, failed: list[RequestOutput]) -> StepPlan:
        """Proposals for the plan; if the proposer fails, each window is proposed alone and the
        requests whose window fails end with an error (the others keep their proposals)."""
        assert self.proposer is not None
        try:
            return self.proposer.propose(plan)
        except Exception:  # noqa: BLE001 - blame is placed below, one window at a time
            log.warning(
                "the proposer failed on a step of %d windows; proposing each alone", len(plan.work)
            )
        work = []
        for i, w in enumerate(plan.work):
            try:
                work += self.proposer.propose(StepPlan([w], plan.free_ids if i == 0 else [])).work
            except Exception as e:  # noqa: BLE001 - this request's window
                if (seq := self.scheduler.running.get(w.request_id)) is not None:
                    failed.append(self._fail(seq, request_fault("proposing", w.request_id, e)))
        return StepPlan(work, plan.free_ids)

    def _update(self, plan: StepPlan, out: StepOutput) -> list[RequestOutput]:
        """scheduler.update one request at a time, so a failing detokenization ends only its own."""
        outputs: list[RequestOutput] = []
        for w in plan.work:
            seq = self.scheduler.running.get(w.request_id)
            try:
                outputs += self.scheduler.update(StepPlan([w]), out)
            except Exception as e:  # noqa: BLE001 - this request's detokenization or stop check
                if seq is not None:
                    outputs.append(
                        self._fail(seq, request_fault("detokenization", w.request_id, e))
                    )
        return outputs

    def _fail(self, seq: SeqState, error: str) -> RequestOutput:
        """End one sequence whatever state a failed update left it in; its detokenizer may be
        the fault, so no more text is decoded for it."""
        seq.detok = IncrementalDetokenizer(None, ())
        o = self.scheduler.abort(seq.request_id, "error", error)
        if o is None:  # the update had already finished it (and queued its cache to be freed)
            o = RequestOutput(
                seq.request_id,
                [],
                "",
                finish_reason="error",
                error=error,
                num_prompt_tokens=len(seq.req.prompt_ids),
                num_output_tokens=len(seq.output_ids),
            )
        return o

    def generate(self, reqs: list[GenerateRequest]) -> Iterator[RequestOutput]:
        """Run requests to completion in-process, yielding outputs as they come."""
        for r in reqs:
            self.add(r)
        while self.has_work():
            yield from self.step()


def kv_blocks_for(runner: object, kv_token_budget: int | None, one_context: int) -> KVBlocks | None:
    """The KV pool's block accounting: blocks for the positions the memory plan reserved, and never fewer
    than one request at the whole context (and its lookahead), so a request alone always fits. Where the
    runner pages its KV (engine/worker/kv_pool.py) these are real blocks and whole prefix blocks are shared
    by reference (unless the prefix cache is off); elsewhere they only count positions (each request keeps
    its own buffer, the copying prefix cache shares prompts). None where the model has no memory plan."""
    if kv_token_budget is None:
        return None
    total = pool_blocks(kv_token_budget, one_context)
    use_pool = getattr(runner, "use_kv_pool", None)
    paged = bool(use_pool is not None and use_pool(total, BLOCK_TOKENS))
    lm = getattr(runner, "lm", None)
    sharing = getattr(getattr(lm, "engine_config", None), "prefix_cache_bytes", 0) > 0
    return KVBlocks(total, BLOCK_TOKENS, cache_prefixes=paged and sharing)
