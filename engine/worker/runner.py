"""Executes a StepPlan on an OffloadedModel: forward each request's window, then sample.

The runner owns the tensors of every request: its KV cache (a transformers DynamicCache,
which can be cropped back after a rejected speculative window) and its RNG.  Requests run
one after another inside a step; a batched forward over padded windows can replace the loop
in `_forward` without changing the plan/output contract.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.structured import GrammarCompiler, TokenConstraint
from engine.worker.loader import OffloadedModel
from engine.core.messages import GenerateRequest, TokenLogprob
from engine.worker.sampling import ban_eos_before_min_tokens, make_generator, sample
from engine.core.scheduler import SeqResult, SeqWork, StepOutput, StepPlan


class ModelRunner:
    def __init__(self, om: OffloadedModel) -> None:
        self.om = om
        self.caches: dict[str, DynamicCache] = {}
        self.generators: dict[str, torch.Generator | None] = {}
        self.eos_ids = sorted(om.eos_token_ids)
        self.constraints: dict[str, TokenConstraint] = {}  # structured-output hook
        self._grammar: GrammarCompiler | None = None  # structured-output hook: built on first use

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        for rid in plan.free_ids:  # finished or aborted: release KV cache memory now
            self.caches.pop(rid, None)
            self.generators.pop(rid, None)
            self.constraints.pop(rid, None)  # structured-output hook
        out = StepOutput()
        for w in plan.work:
            try:
                out.results[w.request_id] = self._run_one(w)
            except Exception as e:  # noqa: BLE001 - one bad request must not kill the others
                self.caches.pop(w.request_id, None)
                self.generators.pop(w.request_id, None)
                self.constraints.pop(w.request_id, None)  # structured-output hook
                out.results[w.request_id] = SeqResult(error=f"{type(e).__name__}: {e}")
        return out

    def _run_one(self, w: SeqWork) -> SeqResult:
        if w.is_prefill:
            self.caches[w.request_id] = DynamicCache(config=self.om.config)
            self.generators[w.request_id] = make_generator(w.req.params, self.om.device)
            if w.req.constraint is not None:  # structured-output hook
                self.constraints[w.request_id] = self._grammar_compiler().make(w.req.constraint)
        cache = self.caches[w.request_id]
        assert cache.get_seq_length() == w.start_pos, "KV cache out of step with the scheduler"
        want_prompt_lp = w.is_prefill and w.req.prompt_logprobs is not None
        inp = torch.tensor([w.input_ids], device=self.om.device)  # [1, T]
        logits = self.om.model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=0 if want_prompt_lp else 1).logits[0]  # [T or 1, V]
        res = SeqResult()
        if want_prompt_lp:
            assert w.req.prompt_logprobs is not None
            lp = torch.log_softmax(logits[:-1].float(), dim=-1)  # position i predicts token i+1
            res.prompt_logprobs = [None] + [_token_logprob(lp[i], t, w.req.prompt_logprobs) for i, t in enumerate(w.input_ids[1:])]
        last = logits[-1]  # [V]
        tok = sample(self._process(last, w), w.req.params, self.generators[w.request_id])
        if (c := self.constraints.get(w.request_id)) is not None:  # structured-output hook
            c.advance(tok)
        res.sampled = [tok]
        if w.req.logprobs is not None:
            # Logprobs of the model's raw distribution (before penalties/temperature), as vLLM does.
            res.logprobs = [_token_logprob(torch.log_softmax(last.float(), dim=-1), tok, w.req.logprobs)]
        return res

    def _process(self, logits: torch.Tensor, w: SeqWork) -> torch.Tensor:
        """Penalties and the min_tokens EOS ban, applied before sampling. logits: [V]."""
        req: GenerateRequest = w.req
        if (req.presence_penalty or req.frequency_penalty) and w.output_ids:
            logits = logits.float().clone()
            ids = torch.tensor(w.output_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)  # [V]
            logits -= req.frequency_penalty * counts + req.presence_penalty * (counts > 0).to(logits.dtype)
        banned = ban_eos_before_min_tokens(logits, self.eos_ids, len(w.output_ids), req.params)
        if (c := self.constraints.get(w.request_id)) is not None:  # structured-output hook
            allowed = c.allowed().to(logits.device)  # [V] bool
            masked = banned.masked_fill(~allowed, float("-inf"))
            # The grammar outranks min_tokens: if only EOS may follow, let it.
            banned = masked if bool(torch.isfinite(masked).any()) else logits.masked_fill(~allowed, float("-inf"))
        return banned

    def _grammar_compiler(self) -> GrammarCompiler:  # structured-output hook
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.om.tokenizer, self.om.config.get_text_config().vocab_size, self.eos_ids)
        return self._grammar


def _token_logprob(lp: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """lp: [V] log-probabilities."""
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, idx = torch.topk(lp, min(k, lp.shape[-1]))
        top = [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return TokenLogprob(token_id, float(lp[token_id]), top)
