"""Executes a StepPlan: one packed forward over every request's window, then sample or verify.

This is the only place where the engine runs the model for generation and picks tokens; the
server's engine process, `moe-offload generate`, the benchmarks and teacher-forced eval all
come through here (eval through `forward`).

The runner owns the tensors of every request: its KV cache (a transformers DynamicCache,
cropped back after a partially accepted window) and its RNG. A failed expert read fails
only the requests whose rows needed that expert: the others are rolled back to the start of
the step and run again. Any other failure of the forward is bisected the same way until the
request it belongs to stands alone, and a failure while sampling (or in the grammar) ends
only its request (engine/core/faults.py); a device (CUDA) fault is re-raised: the engine restarts.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from engine.core.faults import request_fault
from engine.core.step_types import SeqResult, SeqWork, StepOutput, StepPlan
from engine.experts.compute.moe_executor import ExpertLoadError
from engine.experts.routing_bus import StepContext, spans_of
from engine.native.loaded import active
from engine.structured import GrammarCompiler, TokenConstraint
from engine.worker.kv_cache import new_kv_cache, truncate_cache
from engine.worker.kv_pool import KVPool, paged_pool_for
from engine.worker.lean_forward import LeanForward
from engine.worker.loaded_model import LoadedModel
from engine.worker.packed_batch import (
    NO_ROLLBACK_MODEL_TYPES,
    one_by_one_forward,
    packed_forward,
)
from engine.worker.prefix_cache import PrefixCache
from engine.worker.sampling import (
    eos_ban_applies,
    grammar_masked,
    greedy_tokens,
    make_generator,
    process_logits,
    token_logprob,
)
from engine.worker.session_cache import SessionCache, prompt_cache_for
from engine.worker.verify import verify_window

# A faulted device context fails every later call: that is the engine's fault, not a request's.
DEVICE_FAULTS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "AcceleratorError", None),) if t is not None
)


class ModelRunner:
    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.caches: dict[str, DynamicCache] = {}
        self.generators: dict[str, torch.Generator | None] = {}
        self.eos_ids = sorted(lm.eos_token_ids)
        # Structured output: each constrained request's grammar state, advanced by emitted tokens only
        # (proposals are checked by the target's masked distribution, so rejections never touch it).
        self.constraints: dict[str, TokenConstraint] = {}
        self._grammar: GrammarCompiler | None = None  # built on first use
        # The same packed forward without transformers' wrappers, where the plan has it (engine/plan/execution.py;
        # engine/worker/lean_forward.py): a decode step's Python is most of a small model's time.
        plan = getattr(lm, "plan", None)
        lean = (
            lm.packed
            and LeanForward.supports(lm.model)
            and (plan is None or plan.forward != "transformers")
        )
        # Built under the model's native kernels, which it keeps (engine/native/loaded.py).
        with active(lm.native):
            self._lean = (
                LeanForward(
                    lm.model,
                    fused=plan is None or plan.forward == "fused",
                    native_attention=plan is None or plan.native_attention,
                )
                if lean
                else None
            )
        self._stats = getattr(lm, "stats", None)
        # Prompt KV kept across requests: blocks, or snapshots (recurrent or sliding caches); None: off.
        self.prefix: PrefixCache | SessionCache | None = prompt_cache_for(lm)
        # Every request's KV, paged (use_kv_pool), or None: each its own.
        self.pool: KVPool | None = None

    def use_kv_pool(self, total: int, block: int) -> bool:
        """Keep every request's KV in one paged pool of `total` blocks (engine/worker/kv_pool.py), where the
        model's cache allows it; the scheduler's block accounting then decides which blocks each request uses
        and shares prefixes by reference, so the copying prefix cache goes. Returns whether it does."""
        self.pool = paged_pool_for(self.lm, self._lean is not None, total, block)
        if self.pool is None:
            return False
        self.prefix = None
        return True

    # -- the model call ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        windows: list[list[int]],
        starts: list[int],
        caches: list[DynamicCache],
        keep: list[list[int]],
        request_ids: tuple[str, ...] = (),
        kind: str = "forward",
    ) -> list[torch.Tensor]:
        """One packed forward. keep[r]: rows of window r whose logits are returned ([len, V]). kind: the
        step's kind for the path counters (prefill, decode, verify; "forward" for eval and checks).
        Its ops run the model's native kernels, whoever calls (engine/native/loaded.py)."""
        bus = getattr(self.lm, "bus", None)
        if bus is not None:
            bus.step = StepContext.of(request_ids, windows, starts)
        # Every row takes the native kernels where they apply, whatever its kind and whatever shares the
        # step: a request's output never depends on its batch (engine/native/row_kernels.py).
        with active(self.lm.native):
            if self._lean is not None:
                out = self._lean(windows, starts, caches, keep, self.lm.device)
                path, declined = self._lean.last_path
            else:
                run = packed_forward if self.lm.packed else one_by_one_forward
                out = run(self.lm.model, windows, starts, caches, keep, self.lm.device)
                path, declined = "transformers", ""
        if self._stats is not None:
            self._stats.record_step(kind, path, declined)
        return out

    # -- a scheduler step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        # The step's ops run the model's native kernels, sampling and the grammar's included.
        with active(self.lm.native):
            out = self._execute(plan)
        out.seconds = time.perf_counter() - t0
        return out

    def _execute(self, plan: StepPlan) -> StepOutput:
        for rid in plan.free_ids:  # finished or aborted: release KV cache memory now
            self.drop(rid, reusable=True)
        for rid in plan.preempted_ids:  # its KV only: it resumes with its RNG and grammar state
            self._drop_kv(rid, reusable=False)
        out = StepOutput()
        work = list(plan.work)
        for w in work:
            if w.new_seq:
                self.caches[w.request_id] = (
                    self.pool.new_cache(w.prefix_hit)  # the matched blocks are in its table already
                    if self.pool is not None
                    else new_kv_cache(self.lm.config)
                )
                if self.prefix is not None:  # what its admission matched (nothing on a miss)
                    self.prefix.restore(w.request_id, self.caches[w.request_id])
                if w.request_id in self.generators:  # resumed after a preemption
                    continue
                self.generators[w.request_id] = make_generator(w.req.params, self.lm.device)
                if w.req.constraint is not None:
                    try:
                        self.constraints[w.request_id] = self._grammar_compiler().make(
                            w.req.constraint
                        )
                    except Exception as e:  # noqa: BLE001 - a grammar that does not compile fails its request
                        out.results[w.request_id] = SeqResult(
                            error=request_fault("the grammar", w.request_id, e)
                        )
        work = [w for w in work if w.request_id not in out.results]
        if self.pool is not None:
            for w in work:
                self.pool.set_table(self.caches[w.request_id], w.block_table)
        computed = self._forward_by_kind(work, out)
        greedy = self._plain_greedy_tokens(computed)
        for w, lg in computed:
            try:
                # Before _finish: its rollback never reaches the prompt.
                if w.is_prefill and self.prefix is not None:
                    self.prefix.store(
                        w.request_id,
                        w.req.prompt_ids,
                        self.caches[w.request_id],
                        w.start_pos + len(w.input_ids),
                    )
                res = out.results[w.request_id] = self._finish(w, lg, greedy.get(w.request_id))
                if isinstance(self.prefix, SessionCache):  # the tokens its cache holds now
                    self.prefix.ran(w, res.num_kept)
            except Exception as e:  # noqa: BLE001 - sampling, grammar: this request's fault only
                out.results[w.request_id] = SeqResult(
                    error=request_fault("sampling", w.request_id, e)
                )
                self.drop(w.request_id)
        return out

    def _forward_by_kind(
        self, work: list[SeqWork], out: StepOutput
    ) -> list[tuple[SeqWork, torch.Tensor]]:
        """Prompt rows and decode/verification rows take different kernels (engine/native/row_kernels.py),
        so a step that holds both runs them as two forwards: a request's decode rows are then computed
        the same way whether or not a new prompt joined its step, and its output never depends on
        when other requests arrive."""
        prompts = [w for w in work if w.is_prefill]
        rest = [w for w in work if not w.is_prefill]
        few = "verify" if any(w.num_draft for w in rest) else "decode"
        return [
            *(self._forward_contained(prompts, out, "prefill") if prompts else []),
            *(self._forward_contained(rest, out, few) if rest else []),
        ]

    def _forward_contained(
        self, work: list[SeqWork], out: StepOutput, kind: str
    ) -> list[tuple[SeqWork, torch.Tensor]]:
        """Forward `work` (rows of one kind: prefill, decode or verify); a request whose rows fail
        is failed in `out`, the others get logits. A lost expert names its rows; any other error is
        bisected: caches go back to the step's start and each half runs alone, until the failing
        request stands alone."""
        while work:
            try:
                logits = self.forward(
                    [w.input_ids for w in work],
                    [w.start_pos for w in work],
                    [self.caches[w.request_id] for w in work],
                    [self._rows(w) for w in work],
                    tuple(w.request_id for w in work),
                    kind,
                )
                return list(zip(work, logits))
            except ExpertLoadError as e:
                # Fail the requests that needed the lost expert; roll the rest back and rerun.
                bad = self._requests_of_rows(work, e.rows) if self.lm.packed else set()
                if self.lm.config.model_type in NO_ROLLBACK_MODEL_TYPES or not bad:
                    bad = {
                        w.request_id for w in work
                    }  # cannot tell or cannot roll back: fail the step
                for w in work:
                    if w.request_id in bad:
                        out.results[w.request_id] = SeqResult(
                            error=request_fault("expert load", w.request_id, e)
                        )
                        self.drop(w.request_id)
                    else:
                        truncate_cache(self.caches[w.request_id], w.start_pos)
                work = [w for w in work if w.request_id not in bad]
            except Exception as e:  # a bad step fails its requests, not the engine
                if isinstance(e, DEVICE_FAULTS):
                    raise  # a CUDA error poisons the device for everyone: the engine restarts
                if len(work) > 1 and self.lm.config.model_type not in NO_ROLLBACK_MODEL_TYPES:
                    for w in work:
                        truncate_cache(self.caches[w.request_id], w.start_pos)
                    half = len(work) // 2
                    return self._forward_contained(
                        work[:half], out, kind
                    ) + self._forward_contained(work[half:], out, kind)
                for w in work:
                    out.results[w.request_id] = SeqResult(
                        error=request_fault("the forward pass", w.request_id, e)
                    )
                    self.drop(w.request_id)
                return []
        return []

    def drop(self, request_id: str, reusable: bool = False) -> None:
        """Forget a request. `reusable`: it finished or was aborted, so its KV may be kept (not on a failure)."""
        self._drop_kv(request_id, reusable)
        self.generators.pop(request_id, None)
        self.constraints.pop(request_id, None)

    def _drop_kv(self, request_id: str, reusable: bool) -> None:
        cache = self.caches.pop(request_id, None)
        if self.prefix is not None:
            self.prefix.release(request_id, cache if reusable else None)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.lm.tokenizer, self.lm.config.get_text_config().vocab_size, self.eos_ids
            )
        return self._grammar

    # -- per request ----------------------------------------------------------------------
    @staticmethod
    def _rows(w: SeqWork) -> list[int]:
        if w.is_prefill and w.req.prompt_logprobs is not None:
            return list(range(len(w.input_ids)))  # every position predicts the next prompt token
        if not w.samples:
            return []
        T = len(w.input_ids)
        return list(range(T - 1 - w.num_draft, T))  # the verified rows: [last token, proposals]

    @staticmethod
    def _requests_of_rows(work: list[SeqWork], rows: list[int]) -> set[str]:
        spans = spans_of([len(w.input_ids) for w in work])
        return {w.request_id for w, (s, e) in zip(work, spans) if any(s <= r < e for r in rows)}

    def _plain_greedy(self, w: SeqWork, logits: torch.Tensor) -> bool:
        """Whether _finish would take the row's argmax and nothing else: one greedy row to sample, no
        proposals, grammar, logprobs or penalties, and no min_tokens EOS ban in force."""
        req, params = w.req, w.req.params
        return (
            w.samples
            and not w.num_draft
            and logits.shape[0] == 1
            and params.greedy
            and req.logprobs is None
            and not (req.presence_penalty or req.frequency_penalty)
            and w.request_id not in self.constraints
            and not eos_ban_applies(self.eos_ids, len(w.output_ids), params)
        )

    def _plain_greedy_tokens(
        self, computed: list[tuple[SeqWork, torch.Tensor]]
    ) -> dict[str, int | ValueError]:
        """The tokens of the step's plain greedy rows (see _plain_greedy), all from one argmax: per row the
        token _finish would pick, or the error it would raise. A step of 8 decode streams otherwise pays
        8 argmaxes and 8 host reads."""
        plain = [(w, lg) for w, lg in computed if self._plain_greedy(w, lg)]
        if len(plain) < 2:
            return {}
        tokens = greedy_tokens(torch.cat([lg for _, lg in plain]))
        return {w.request_id: t for (w, _), t in zip(plain, tokens)}

    def _finish(
        self, w: SeqWork, logits: torch.Tensor, greedy: int | ValueError | None = None
    ) -> SeqResult:
        """logits: [len(_rows(w)), V]. greedy: the row's token when _plain_greedy_tokens took it (or the
        error it met), which is all a plain greedy row needs."""
        if isinstance(greedy, ValueError):
            raise greedy
        if greedy is not None:
            return SeqResult(sampled=[greedy], num_kept=len(w.input_ids))
        res = SeqResult()
        if w.is_prefill and w.req.prompt_logprobs is not None:
            lp = torch.log_softmax(logits[:-1].float(), dim=-1)  # position i predicts token i+1
            res.prompt_logprobs = [None] + [
                token_logprob(lp[i], t, w.req.prompt_logprobs)
                for i, t in enumerate(w.input_ids[1:])
            ]
            logits = logits[-1:]
        if not w.samples:
            return res
        drafts = w.draft_ids
        probs = w.draft_probs if isinstance(w.draft_probs, torch.Tensor) else None
        grammar = self.constraints.get(w.request_id)
        advanced = [0]  # emitted tokens of this window already fed to the grammar

        def process(row: torch.Tensor, accepted: list[int]) -> torch.Tensor:
            if grammar is not None:  # the grammar state must follow the tokens accepted so far
                for t in accepted[advanced[0] :]:
                    grammar.advance(t)
                advanced[0] = len(accepted)
            return self._process(row, w, accepted, grammar)

        # The first verified row's position.
        first = w.start_pos + len(w.input_ids) - 1 - w.num_draft
        tokens = verify_window(
            logits,
            drafts,
            w.req.params,
            generator=self.generators[w.request_id],
            process=process,
            draft_probs=probs,
            first_position=first,
        )
        if grammar is not None:
            for t in tokens[advanced[0] :]:
                grammar.advance(t)
        accepted = len(tokens) - 1
        res.sampled = tokens
        # The rejected tail leaves the cache.
        res.num_kept = len(w.input_ids) - w.num_draft + accepted
        if res.num_kept < len(w.input_ids):
            truncate_cache(self.caches[w.request_id], w.start_pos + res.num_kept)
        if w.req.logprobs is not None:
            # Logprobs of the model's raw distribution (before penalties/temperature), as vLLM does.
            lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
            res.logprobs = [token_logprob(lp[i], t, w.req.logprobs) for i, t in enumerate(tokens)]
        return res

    def _process(
        self,
        logits: torch.Tensor,
        w: SeqWork,
        accepted: list[int],
        grammar: TokenConstraint | None = None,
    ) -> torch.Tensor:
        """Penalties, the min_tokens EOS ban and the grammar's mask, applied before sampling. logits: [V]."""
        req = w.req
        banned = process_logits(
            logits,
            req.params,
            w.output_ids,
            extra=accepted,
            presence=req.presence_penalty,
            frequency=req.frequency_penalty,
            eos_ids=self.eos_ids,
        )
        if grammar is None:
            return banned
        return grammar_masked(logits, banned, grammar.allowed().to(logits.device))
