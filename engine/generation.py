"""Single-request generation: prefill, then decode with a KV cache, one token per step."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engine.core.detokenizer import IncrementalDetokenizer
from engine.worker.loader import LoadedModel
from engine.worker.sampling import SamplingParams, ban_eos_before_min_tokens, make_generator, sample


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first token comes from prefill; decode speed counts the tokens after it.
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


@torch.inference_mode()
def stream_generate(om: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> Iterator[GenerationResult]:
    """Yield the (growing) result after each new token; the last yield has finish_reason set."""
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    res = GenerationResult(prompt_tokens=len(prompt_ids))
    eos = set() if params.ignore_eos else om.eos_token_ids
    eos_list = sorted(eos)
    gen = make_generator(params, om.device)
    cache = DynamicCache(config=om.config)
    detok = IncrementalDetokenizer(om.tokenizer, params.stop)

    t0 = time.perf_counter()
    inp = torch.tensor([prompt_ids], device=om.device)
    logits = om.model(input_ids=inp, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    res.prefill_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    while True:
        nxt = sample(ban_eos_before_min_tokens(logits, eos_list, len(res.tokens), params), params, gen)
        res.tokens.append(nxt)
        if nxt in eos:
            res.tokens.pop()  # EOS ends the text and is not part of it
            res.finish_reason = "stop"
        else:
            detok.append([nxt])  # decodes and cuts the text before a stop string
            res.text = detok.text
            if detok.stopped:
                res.finish_reason = "stop"
        if res.finish_reason is None and len(res.tokens) >= params.max_tokens:
            res.finish_reason = "length"
        res.decode_seconds = time.perf_counter() - t1
        yield res
        if res.finish_reason is not None:
            return
        inp = torch.tensor([[nxt]], device=om.device)
        logits = om.model(input_ids=inp, cache=cache, use_cache=True).logits[0, -1]


def generate(om: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    res = None
    for res in stream_generate(om, prompt_ids, params):
        pass
    assert res is not None
    return res


@torch.inference_mode()
def prompt_logits(om: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [S, V] for a prompt in one forward pass (used by parity tests)."""
    return om.model(input_ids=torch.tensor([ids], device=om.device), use_cache=False).logits[0]
