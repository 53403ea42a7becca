"""Next-token selection: greedy, or temperature / top-k / top-p sampling with a seed."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.sampling_params import (
    SamplingParams,  # re-exported: its home is core (plain data)
)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to [V] logits; returns masked, scaled float32 logits."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the token that crosses p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    return logits


def ban_eos_before_min_tokens(logits: torch.Tensor, eos_ids: list[int], generated: int, params: SamplingParams) -> torch.Tensor:
    """min_tokens: make EOS impossible until enough tokens exist (so it is never emitted as text)."""
    if eos_ids and not params.ignore_eos and generated < params.min_tokens:
        logits = logits.clone()
        logits[eos_ids] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI presence/frequency penalties over the tokens generated so far. logits: [V]."""
    if (presence or frequency) and output_ids:
        logits = logits.float().clone()
        counts = torch.bincount(torch.tensor(list(output_ids), device=logits.device), minlength=logits.shape[-1]).to(logits.dtype)  # [V]
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int], extra: Sequence[int],
                   presence: float, frequency: float, eos_ids: list[int]) -> torch.Tensor:
    """What every token choice (the target's, a draft's) applies before sampling: penalties over
    the tokens so far (`output_ids` then `extra`, e.g. tokens accepted earlier in a window) and
    the min_tokens EOS ban. The token history is only built when a penalty needs it."""
    if presence or frequency:
        logits = apply_penalties(logits, [*output_ids, *extra], presence, frequency)
    return ban_eos_before_min_tokens(logits, eos_ids, len(output_ids) + len(extra), params)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, top-k, top-p applied. [V] -> [V]."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from [V] logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(target_probs(logits, params), 1, generator=generator))
