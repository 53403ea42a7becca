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
from dataclasses import replace
from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.kv_blocks import KVBlocks
from engine.core.messages import GenerateRequest, RequestOutput, TokenLogprob
from engine.core.step_types import SeqState, SeqWork, Status, StepOutput, StepPlan


class Scheduler:
    """FCFS admission under a running-request cap, the KV pool's free blocks and a per-step prefill
    token budget, with preemption when the pool runs out.

    Decodes of running requests are never starved: every step decodes every running request.
    Prompt tokens are prefilled up to `prefill_token_budget` per step; a longer prompt is
    split into chunks over several steps (chunks and decodes share a step). A prompt that
    asks for prompt logprobs is prefilled whole, in one step.

    `blocks` (engine/core/kv_blocks.py; None: no limit): every window runs only once its positions
    have blocks. A waiting request is admitted, in order, when its first chunk's blocks are there
    (after the blocks its prefix matched); otherwise it waits (never an error). When a running
    request's next window finds no block, the most recently admitted request is preempted: its
    blocks go back (its whole blocks stay cached for its return), it waits at the head of the queue
    and, resumed, recomputes its positions from its tokens, each with the bits it had (every row
    computes the same whatever shares its step), so its output is the one it gets alone. vLLM's
    recompute preemption. `lookahead`: proposals a decode window may carry (speculative decoding);
    its blocks are asked for, and a window gets fewer proposals rather than preempting another.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: set[int],
        max_running: int,
        prefill_token_budget: int,
        max_model_len: int,
        prefix: Any = None,
        blocks: KVBlocks | None = None,
        lookahead: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_running = max_running
        self.prefill_token_budget = prefill_token_budget
        self.max_model_len = max_model_len
        self.waiting: deque[SeqState] = deque()
        self.running: dict[str, SeqState] = {}  # in admission order
        self._to_free: list[str] = []
        # The runner's own prompt cache where no pool shares blocks: copied blocks (engine/worker/prefix_cache.py)
        # or conversation snapshots (engine/worker/session_cache.py).
        self.prefix = prefix
        self.blocks = blocks
        self.lookahead = lookahead
        self.preemptions = 0  # all requests, since start
        self._failed: list[RequestOutput] = []  # ended at admission; reported by the next update()

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
            if seq.preemptions:  # its runner state (RNG, grammar) outlived its KV
                self._to_free.append(request_id)
        if self.blocks is not None:
            self.blocks.free(request_id)
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
        for seq in list(self.running.values()):
            if seq.request_id not in self.running:  # preempted for an earlier request's window
                continue
            if seq.num_computed < seq.fill_len:  # a prompt still being prefilled in chunks
                if budget <= 0:
                    continue
                wanted = self._prefill_chunk(seq, budget)
            else:
                wanted = self._decode_window(seq)
            work = self._with_blocks(seq, wanted, plan)
            if work is not None:
                plan.work.append(work)
                budget -= len(work.input_ids) if work.is_prefill else 0
        while (
            self.waiting
            and len(self.running) < self.max_running
            and budget > 0
            and not plan.preempted_ids  # no admission in a step that had to take blocks back
        ):
            seq = self.waiting[0]
            if (
                seq.req.prompt_logprobs is not None
                and not seq.output_ids
                and len(seq.req.prompt_ids) > budget
                and budget < self.prefill_token_budget
            ):
                break  # needs a whole-prompt step; it gets the next one
            if self._prefix_in_flight(seq):
                break  # its prefix is being prefilled by a running request: it starts when it can share it
            admitted = self._admit(seq, budget)
            if admitted is None:
                break  # waits, in order, for running requests to free their blocks
            if admitted.request_id in self.running:
                plan.work.append(admitted)
                budget -= len(admitted.input_ids)
        return plan

    def _admit(self, seq: SeqState, budget: int) -> SeqWork | None:
        """`seq`'s first chunk, started, if its blocks are there (after its prefix's); None if it must
        wait. A request the whole pool cannot hold ends with an error (its work is returned, not run)."""
        rid = seq.request_id
        hit = 0
        if seq.req.prompt_logprobs is None or seq.output_ids:  # prompt logprobs need every position
            if self.blocks is not None:  # a paged pool shares blocks; counting only, it finds none
                hit = self.blocks.match(rid, seq.fill_ids)
            if not hit and self.prefix is not None:
                hit = self.prefix.match(rid, seq.fill_ids)
        seq.num_computed = seq.num_cached = hit
        work = self._prefill_chunk(seq, budget)
        if self.blocks is not None and not self._room_to_start(
            rid, work.start_pos + len(work.input_ids)
        ):
            if self.prefix is not None:
                self.prefix.release(rid)  # not admitted now: what it matched is not held for it
            if (
                not self.running
            ):  # alone, the pool still cannot hold it: the pool is smaller than a context
                if (
                    o := self.abort(rid, "error", "the KV pool cannot hold this request")
                ) is not None:
                    self._failed.append(o)
                return work
            self.blocks.cancel(rid)
            seq.num_computed = seq.num_cached = 0
            return None
        self.waiting.popleft()
        seq.status = Status.RUNNING
        if seq.queue_seconds is None:
            seq.queue_seconds = time.monotonic() - seq.arrival
        self.running[rid] = seq
        return self._tabled(work)

    def _prefix_in_flight(self, seq: SeqState) -> bool:
        """Whether a running request is still prefilling a whole block that `seq` starts with too: started
        now, `seq` would compute its own copy; a step later it shares the blocks by reference."""
        if (
            self.blocks is None
            or not self.blocks.cache_prefixes
            or seq.req.prompt_logprobs is not None
        ):
            return False
        ids, block = seq.fill_ids, self.blocks.block
        for other in self.running.values():
            upto = (
                other.num_computed // block + 1
            ) * block  # the end of its first block not yet computed
            if (
                other.num_computed < other.fill_len
                and len(ids) > upto
                and ids[:upto] == other.fill_ids[:upto]
            ):
                return True
        return False

    def _room_to_start(self, rid: str, positions: int) -> bool:
        """Allocate a new request's first positions if, beside them, every running request keeps a block to
        grow into: admitting into the last free blocks would preempt within a block's steps (thrashing)."""
        assert self.blocks is not None
        spare = self.blocks.available() - self.blocks.needs(rid, positions)
        return spare >= len(self.running) and self.blocks.allocate(rid, positions)

    def _decode_window(self, seq: SeqState) -> SeqWork:
        total = len(seq.req.prompt_ids) + len(seq.output_ids)
        room = min(seq.req.params.max_tokens - len(seq.output_ids), self.max_model_len - total) - 1
        return SeqWork(
            seq.request_id,
            [seq.output_ids[-1]],
            seq.num_computed,
            False,
            seq.req,
            tuple(seq.output_ids),
            max_draft=max(room, 0),
        )

    def _with_blocks(self, seq: SeqState, work: SeqWork, plan: StepPlan) -> SeqWork | None:
        """`work` with the blocks its positions need, taking them back from the most recently admitted
        requests if the pool is out; None if `seq` itself had to give its blocks back."""
        if self.blocks is None:
            return work
        rid, end = seq.request_id, work.start_pos + len(work.input_ids)
        if not work.is_prefill and self.blocks.allocate(
            rid, end + min(work.max_draft, self.lookahead)
        ):
            return self._tabled(work)
        while not self.blocks.allocate(rid, end):
            victim = next(reversed(self.running.values()))
            self._preempt(victim, plan)
            if victim is seq:
                return None
        return self._tabled(work)

    def _tabled(self, work: SeqWork) -> SeqWork:
        """`work` with its block table; a decode window's proposals capped by the positions it covers."""
        if self.blocks is None:
            return work
        table = tuple(self.blocks.table(work.request_id))
        covered = len(table) * self.blocks.block - work.start_pos - len(work.input_ids)
        return replace(work, block_table=table, max_draft=max(0, min(work.max_draft, covered)))

    def _preempt(self, seq: SeqState, plan: StepPlan) -> None:
        """Take `seq`'s blocks back; it waits at the head of the queue and recomputes them when resumed."""
        assert self.blocks is not None
        rid = seq.request_id
        del self.running[rid]
        self.blocks.free(rid)
        seq.status, seq.num_computed, seq.num_cached = Status.WAITING, 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted_ids.append(rid)
        plan.work = [w for w in plan.work if w.request_id != rid]

    def _prefill_chunk(self, seq: SeqState, budget: int) -> SeqWork:
        """The next chunk of `seq`'s tokens to prefill: its prompt, or after a preemption its prompt and
        outputs (that chunk samples nothing: its next token is known)."""
        ids, resumed = seq.fill_ids, bool(seq.output_ids)
        start = seq.num_computed
        whole = seq.req.prompt_logprobs is not None and not resumed
        end = len(ids) if whole else min(len(ids), start + budget)
        return SeqWork(
            seq.request_id,
            list(ids[start:end]),
            start,
            True,
            seq.req,
            tuple(seq.output_ids),
            samples=end == len(ids) and not resumed,
            prefix_hit=seq.num_cached,
        )

    def update(self, plan: StepPlan, out: StepOutput) -> list[RequestOutput]:
        outputs, self._failed = self._failed, []
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
            self._commit(seq)  # its whole computed blocks become shareable
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
                if self.blocks is not None:
                    self._commit(seq)  # accepted proposals may have completed a block
                    self.blocks.free(w.request_id)
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

    def _commit(self, seq: SeqState) -> None:
        """Register `seq`'s newly completed whole blocks for sharing; its tokens are concatenated only when a
        block completed (every 16 positions), not at every step."""
        if self.blocks is not None and self.blocks.uncommitted(seq.request_id, seq.num_computed):
            self.blocks.commit(
                seq.request_id, seq.req.prompt_ids + seq.output_ids, seq.num_computed
            )

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
