"""Request states and the per-step plan: which requests run, with which input positions.

The scheduler holds no tensors (the runner owns KV caches and RNGs), so it is testable on CPU
without a model.  One engine step is

    plan = scheduler.schedule()        # decide: decodes for every running request + admitted prefills
    out = runner.execute(plan)         # compute: forward each window, sample
    outputs = scheduler.update(plan, out)   # account: append tokens, stop checks, detokenize, free

Every work item is a *window* of positions (`input_ids`, starting at `start_pos`): the whole
prompt at prefill, the last sampled token at decode, and later the last token plus k draft
tokens for speculative verification; `SeqResult.sampled` may then hold up to k+1 accepted
tokens and the runner crops the KV cache back to `start_pos + accepted`.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.messages import GenerateRequest, RequestOutput, TokenLogprob


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqState:
    req: GenerateRequest
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_computed: int = 0  # positions already in this request's KV cache
    output_ids: list[int] = field(default_factory=list)
    queue_seconds: float | None = None
    sent_first: bool = False

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass(frozen=True)
class SeqWork:
    """One request's window in a step (plain data: the runner looks up its cache by id)."""

    request_id: str
    input_ids: list[int]  # [T] positions to run
    start_pos: int  # KV cache length before this window
    is_prefill: bool
    req: GenerateRequest
    output_ids: tuple[int, ...]  # tokens generated so far (penalties, min_tokens)


@dataclass
class StepPlan:
    work: list[SeqWork] = field(default_factory=list)
    free_ids: list[str] = field(default_factory=list)  # requests whose KV cache/RNG the runner drops


@dataclass
class SeqResult:
    sampled: list[int] = field(default_factory=list)  # accepted new tokens (1 without speculation)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


@dataclass
class StepOutput:
    results: dict[str, SeqResult] = field(default_factory=dict)


class Scheduler:
    """FCFS admission under a running-request cap and a per-step prefill token budget.

    Decodes of running requests are never starved: every step decodes every running request,
    and admits new prefills only up to `prefill_token_budget` prompt tokens (at least one).
    """

    def __init__(self, tokenizer: Any, eos_ids: set[int], max_running: int, prefill_token_budget: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_running = max_running
        self.prefill_token_budget = prefill_token_budget
        self.max_model_len = max_model_len
        self.waiting: deque[SeqState] = deque()
        self.running: dict[str, SeqState] = {}
        self._to_free: list[str] = []

    # -- inputs ------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> None:
        self.waiting.append(SeqState(req, IncrementalDetokenizer(self.tokenizer, req.params.stop)))

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        """Drop a request wherever it is; returns its final output, or None if unknown."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self._to_free.append(request_id)
        else:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        return self._output(seq, [], None, None, reason, error)

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
        ids = list(self.running) + [s.request_id for s in self.waiting]
        return [o for rid in ids if (o := self.abort(rid, reason, error)) is not None]

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._to_free)

    # -- step --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(free_ids=self._to_free)
        self._to_free = []
        for seq in self.running.values():
            plan.work.append(SeqWork(seq.request_id, [seq.output_ids[-1]], seq.num_computed, False, seq.req, tuple(seq.output_ids)))
        budget = self.prefill_token_budget
        admitted = 0
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = len(seq.req.prompt_ids)
            if admitted and n > budget:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.queue_seconds = time.monotonic() - seq.arrival
            self.running[seq.request_id] = seq
            plan.work.append(SeqWork(seq.request_id, list(seq.req.prompt_ids), 0, True, seq.req, ()))
            budget -= n
            admitted += 1
        return plan

    def update(self, plan: StepPlan, out: StepOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for w in plan.work:
            seq = self.running.get(w.request_id)
            res = out.results.get(w.request_id)
            if seq is None or res is None:  # aborted while the step ran
                continue
            if res.error is not None:
                if (o := self.abort(w.request_id, "error", res.error)) is not None:
                    outputs.append(o)
                continue
            seq.num_computed = w.start_pos + len(w.input_ids)
            new: list[int] = []
            lps: list[TokenLogprob] = []
            finish: str | None = None
            eos_lp: TokenLogprob | None = None
            p = seq.req.params
            for i, tok in enumerate(res.sampled):
                if tok in self.eos_ids and not p.ignore_eos:
                    finish = "stop"  # EOS ends the text and is not part of it (nor of usage)
                    eos_lp = res.logprobs[i] if res.logprobs is not None else None  # lm_eval exactness (issue 14)
                    break
                seq.output_ids.append(tok)
                new.append(tok)
                if res.logprobs is not None:
                    lps.append(res.logprobs[i])
                seq.detok.append([tok])
                if seq.detok.stopped:
                    finish = "stop"
                elif len(seq.output_ids) >= p.max_tokens or seq.num_computed + 1 >= self.max_model_len:
                    finish = "length"
                if finish:
                    break
            if finish:
                seq.status = Status.FINISHED
                del self.running[w.request_id]
                self._to_free.append(w.request_id)
            ro = self._output(seq, new, lps if res.logprobs is not None else None, res.prompt_logprobs, finish, None)
            outputs.append(dataclasses.replace(ro, eos_logprob=eos_lp) if eos_lp is not None else ro)
        return outputs

    def _output(self, seq: SeqState, new: list[int], lps: list[TokenLogprob] | None, plps: list[TokenLogprob | None] | None, finish: str | None, error: str | None) -> RequestOutput:
        first = not seq.sent_first
        seq.sent_first = True
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=new,
            text=seq.detok.release(final=finish is not None),
            logprobs=lps,
            prompt_logprobs=plps,
            finish_reason=finish,
            error=error,
            num_prompt_tokens=len(seq.req.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            queue_seconds=seq.queue_seconds if first else None,
        )
