"""Request states and the per-step plan: which requests run, with which window of positions.

The scheduler holds no tensors (the runner owns KV caches and RNGs), so it is testable on CPU
without a model.  One engine step (engine/core/engine_core.py) is

    plan = scheduler.schedule()              # decide: a window for every running request
    out = runner.execute(plan)               # compute: one packed forward, sample / verify
    outputs = scheduler.update(plan, out)    # account: advance, stop checks, detokenize, free

Every work item is a *window* of positions (`input_ids`, starting at `start_pos`): a chunk of
the prompt at prefill, the last sampled token at decode, or the last token plus k proposed
tokens for speculative verification.  `SeqResult.num_kept` says how many positions of the
window stay in the KV cache (the runner has already cropped it to that), and the scheduler
advances by exactly that count, so a window that keeps 1 of 5 positions rolls back cleanly.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
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
    num_cached: int = 0  # prompt positions restored from the prefix cache at admission

    @property
    def request_id(self) -> str:
        return self.req.request_id


@dataclass(frozen=True)
class SeqWork:
    """One request's window in a step (plain data: the runner looks up its cache by id)."""

    request_id: str
    input_ids: list[int]  # [T] positions to run
    start_pos: int  # KV cache length before this window
    is_prefill: bool  # the window holds prompt tokens (the first chunk creates the KV cache)
    req: GenerateRequest
    output_ids: tuple[int, ...]  # tokens generated so far (penalties, min_tokens)
    samples: bool = True  # False for a prompt chunk that does not reach the prompt's end
    num_draft: int = 0  # the last num_draft input_ids are proposed tokens to verify
    max_draft: int = 0  # proposals the request can still use (max_tokens and context left)
    draft_probs: object | None = (
        None  # the proposer's distributions [num_draft, V], None = deterministic
    )
    prefix_hit: int = (
        0  # prompt positions the runner restores from the prefix cache before the first chunk
    )

    @property
    def new_seq(self) -> bool:
        return self.is_prefill and self.start_pos == self.prefix_hit

    @property
    def draft_ids(self) -> list[int]:
        return self.input_ids[len(self.input_ids) - self.num_draft :] if self.num_draft else []


@dataclass
class StepPlan:
    work: list[SeqWork] = field(default_factory=list)
    free_ids: list[str] = field(
        default_factory=list
    )  # requests whose KV cache/RNG the runner drops


@dataclass
class SeqResult:
    sampled: list[int] = field(default_factory=list)  # new tokens: accepted proposals + one sampled
    num_kept: int | None = None  # window positions kept in the KV cache; None = all of them
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


@dataclass
class StepOutput:
    results: dict[str, SeqResult] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the runner's execute (cost measurements, e.g. adaptive k)


class Scheduler:
    """FCFS admission under a running-request cap, a KV token budget and a per-step prefill
    token budget.

    Decodes of running requests are never starved: every step decodes every running request.
    Prompt tokens are prefilled up to `prefill_token_budget` per step; a longer prompt is
    split into chunks over several steps (chunks and decodes share a step). A prompt that
    asks for prompt logprobs is prefilled whole, in one step.

    `kv_token_budget` (the KV positions the memory plan reserved; None: no limit): a request is
    admitted only while the positions the running requests hold now (prompt and output so far)
    plus its prompt fit in it; otherwise it waits, in order, until running requests finish (never
    an error). A request alone is always admitted, so one longer than the budget still runs.
    Why not each request's worst case (prompt + max_tokens): agents send max_tokens of 32k, and
    the worst case would run their sessions one at a time. What is missing is preemption: the
    running requests' outputs may still grow past the budget.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: set[int],
        max_running: int,
        prefill_token_budget: int,
        max_model_len: int,
        prefix: Any = None,
        kv_token_budget: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_running = max_running
        self.prefill_token_budget = prefill_token_budget
        self.max_model_len = max_model_len
        self.waiting: deque[SeqState] = deque()
        self.running: dict[str, SeqState] = {}
        self._to_free: list[str] = []
        self.prefix = prefix  # engine/worker/prefix_cache.py's PrefixCache (match() only), or None
        self.kv_token_budget = kv_token_budget

    def kv_need(self, seq: SeqState) -> int:
        """The KV positions a request holds now: its prompt and the tokens it generated so far,
        at most the context."""
        return min(len(seq.req.prompt_ids) + len(seq.output_ids), self.max_model_len)

    def _kv_fits(self, seq: SeqState) -> bool:
        if self.kv_token_budget is None or not self.running:
            return True
        held = sum(self.kv_need(s) for s in self.running.values())
        return held + self.kv_need(seq) <= self.kv_token_budget

    # -- inputs ------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> None:
        self.waiting.append(SeqState(req, IncrementalDetokenizer(self.tokenizer, req.params.stop)))

    def abort(
        self, request_id: str, reason: str = "abort", error: str | None = None
    ) -> RequestOutput | None:
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
        budget = self.prefill_token_budget
        for seq in self.running.values():
            n_prompt = len(seq.req.prompt_ids)
            if seq.num_computed < n_prompt:  # a prompt still being prefilled in chunks
                if budget > 0:
                    plan.work.append(self._prefill_chunk(seq, budget))
                    budget -= len(plan.work[-1].input_ids)
                continue
            total = n_prompt + len(seq.output_ids)
            room = (
                min(seq.req.params.max_tokens - len(seq.output_ids), self.max_model_len - total) - 1
            )
            plan.work.append(
                SeqWork(
                    seq.request_id,
                    [seq.output_ids[-1]],
                    seq.num_computed,
                    False,
                    seq.req,
                    tuple(seq.output_ids),
                    max_draft=max(room, 0),
                )
            )
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            seq = self.waiting[0]
            if (
                seq.req.prompt_logprobs is not None
                and len(seq.req.prompt_ids) > budget
                and budget < self.prefill_token_budget
            ):
                break  # needs a whole-prompt step; it gets the next one
            if not self._kv_fits(seq):
                break  # waits, in order, for running requests to free their KV
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.queue_seconds = time.monotonic() - seq.arrival
            if (
                self.prefix is not None and seq.req.prompt_logprobs is None
            ):  # prompt logprobs need every position
                seq.num_computed = seq.num_cached = self.prefix.match(
                    seq.request_id, seq.req.prompt_ids
                )
            self.running[seq.request_id] = seq
            plan.work.append(self._prefill_chunk(seq, budget))
            budget -= len(plan.work[-1].input_ids)
        return plan

    def _prefill_chunk(self, seq: SeqState, budget: int) -> SeqWork:
        prompt = seq.req.prompt_ids
        start = seq.num_computed
        end = (
            len(prompt) if seq.req.prompt_logprobs is not None else min(len(prompt), start + budget)
        )
        return SeqWork(
            seq.request_id,
            list(prompt[start:end]),
            start,
            True,
            seq.req,
            (),
            samples=end == len(prompt),
            prefix_hit=seq.num_cached,
        )

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
            # Advance by what the runner kept (a rejected speculative tail is already cropped).
            seq.num_computed = w.start_pos + (
                len(w.input_ids) if res.num_kept is None else res.num_kept
            )
            if not w.samples:  # a prompt chunk short of the prompt's end: nothing to emit yet
                continue
            new: list[int] = []
            lps: list[TokenLogprob] = []
            finish: str | None = None
            eos_lp: TokenLogprob | None = None
            p = seq.req.params
            n_prompt = len(seq.req.prompt_ids)
            for i, tok in enumerate(res.sampled):
                if tok in self.eos_ids and not p.ignore_eos:
                    finish = "stop"  # EOS ends the text and is not part of it (nor of usage)
                    eos_lp = (
                        res.logprobs[i] if res.logprobs is not None else None
                    )  # lm_eval exactness (issue 14)
                    break
                seq.output_ids.append(tok)
                new.append(tok)
                if res.logprobs is not None:
                    lps.append(res.logprobs[i])
                seq.detok.append([tok])
                if seq.detok.stopped:
                    finish = "stop"
                elif (
                    len(seq.output_ids) >= p.max_tokens
                    or n_prompt + len(seq.output_ids) >= self.max_model_len
                ):
                    finish = "length"
                if finish:
                    break  # nothing after a stop is emitted, even if the window produced more
            if finish:
                seq.status = Status.FINISHED
                del self.running[w.request_id]
                self._to_free.append(w.request_id)
            ro = self._output(
                seq,
                new,
                lps if res.logprobs is not None else None,
                res.prompt_logprobs,
                finish,
                None,
            )
            outputs.append(replace(ro, eos_logprob=eos_lp) if eos_lp is not None else ro)
        return outputs

    def _output(
        self,
        seq: SeqState,
        new: list[int],
        lps: list[TokenLogprob] | None,
        plps: list[TokenLogprob | None] | None,
        finish: str | None,
        error: str | None,
    ) -> RequestOutput:
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
            stop_sequence=seq.detok.matched if finish == "stop" else None,
            num_cached_tokens=seq.num_cached,
        )
