"""Next-token selection: greedy, or temperature / top-k / top-p sampling with a seed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.core.messages import TokenLogprob
from engine.core.sampling_params import (
    SamplingParams,  # re-exported: its home is core (plain data)
)


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator for a seeded request's token predicted by the row at `position`: a function of the
    seed and the position alone, so the token drawn there is the same whether the request runs alone or
    batched, and whether or not speculation proposed it (engine/worker/verify.py)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + position) % (1 << 63))
    return g


def seeded_draw(weights: torch.Tensor, seed: int, position: int) -> int:
    """The token a seeded request draws from [V] `weights` at the row `position`: an exponential race,
    argmax of weight / e over one Exp(1) draw e per token from the seed and the position, which picks
    each token with probability weight / sum. The target's own token (engine/worker/verify.py) and the
    draft's proposal there (engine/speculative/draft.py) race with the same e, so the two agree with
    probability at least (1 - d) / (1 + d) for distributions d apart in total variation, where two
    inverse-CDF draws at one shared uniform drift apart with every token the cumulative sums differ on."""
    g = seeded_generator(seed, position, weights.device)
    e = torch.empty(weights.shape, dtype=torch.float64, device=weights.device).exponential_(
        generator=g
    )
    return int(torch.argmax(weights.double() / e))  # the one host read


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


# Temperatures are clamped into [MIN_TEMPERATURE, MAX_TEMPERATURE] before dividing: below the floor
# a logit gap of 1 would overflow float32 (greedy is the limit there, and the server maps such
# values to 0 = greedy, as vLLM does); above the ceiling float32 cannot tell the distributions
# apart from uniform over the finite logits, and dividing by inf would turn -inf into NaN.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e30


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """[V] logits of any dtype -> float32 [V] with no NaN and no +inf, at least one finite entry.

    NaN means "unknown": that token is never chosen (-inf). If some logits are +inf, those
    tokens share all the mass (the limit of ever larger logits), so they become 0 and the rest
    -inf. Raises ValueError when no token is left (every logit NaN or -inf)."""
    x = logits.float()
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    pos = x == float("inf")
    if bool(pos.any()):
        x = torch.zeros_like(x).masked_fill(~pos, float("-inf"))
    if not bool(torch.isfinite(x).any()):
        raise ValueError("no token can be sampled: every logit is NaN or -inf")
    return x


def greedy_token(logits: torch.Tensor) -> int:
    """argmax of [V] logits, never a NaN one. Fast path: argmax already landed on a number.

    The index and its logit come to the host in one read (as float64, exact for any vocabulary
    index): on a GPU that is the decode step's one synchronization (tests/test_host_reads.py)."""
    at = torch.argmax(logits)
    i_f, v = torch.stack([at.double(), logits[at].double()]).tolist()
    i = int(i_f)
    if not math.isnan(v) and v != float("-inf"):  # some token is possible
        return i
    return int(torch.argmax(sanitize_logits(logits)))


def greedy_tokens(logits: torch.Tensor) -> list[int | ValueError]:
    """greedy_token of each row of [R, V] logits, with one reduction and one host read for all rows (a
    step of R plain greedy decode rows; on the CPU torch.max over the rows costs a fifth of R 1-d
    argmaxes). max picks each row's first maximum, as argmax does for one row; a row whose maximum is
    NaN or -inf takes greedy_token's own path. So every row gets exactly its single-row answer, or the
    ValueError greedy_token would raise for it."""
    values, at = torch.max(logits, dim=-1)  # [R]: the first maximum of each row, as argmax's
    pairs = torch.stack([at.double(), values.double()], dim=1).tolist()
    out: list[int | ValueError] = []
    for r, (i_f, v) in enumerate(pairs):
        if not math.isnan(v) and v != float("-inf"):
            out.append(int(i_f))
            continue
        try:
            out.append(greedy_token(logits[r]))
        except ValueError as e:  # every logit NaN or -inf: that row's request fails, not the others
            out.append(e)
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to [V] logits; returns masked, scaled float32 logits.

    Safe by construction: the most likely token always survives with logit 0 (the maximum is
    subtracted before the temperature, so nothing overflows upwards), top-k and top-p keep at
    least it (greedy is their limit), so the softmax of the result is a valid distribution."""
    x = sanitize_logits(logits)
    t = min(max(params.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
    x = (x - x.max()) / t  # [V], max exactly 0; an overflow below is just a zero probability
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True, stable=True)  # ties: the lower id, every run
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the token that crosses p
        drop[0] = False  # and always the most likely one (a top_p below float32's resolution)
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    return x


def eos_ban_applies(eos_ids: list[int], generated: int, params: SamplingParams) -> bool:
    """Whether min_tokens still bans EOS after `generated` tokens."""
    return bool(eos_ids) and not params.ignore_eos and generated < params.min_tokens


def ban_eos_before_min_tokens(
    logits: torch.Tensor, eos_ids: list[int], generated: int, params: SamplingParams
) -> torch.Tensor:
    """min_tokens: make EOS impossible until enough tokens exist (so it is never emitted as text)."""
    if eos_ban_applies(eos_ids, generated, params):
        logits = logits.clone()
        logits[eos_ids] = float("-inf")
    return logits


def apply_penalties(
    logits: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI presence/frequency penalties over the tokens generated so far. logits: [V]."""
    if not (math.isfinite(presence) and math.isfinite(frequency)):
        raise ValueError(
            f"presence and frequency penalties must be finite, got {presence} and {frequency}"
        )
    if (presence or frequency) and output_ids:
        logits = logits.float().clone()
        counts = torch.bincount(
            torch.tensor(list(output_ids), device=logits.device), minlength=logits.shape[-1]
        ).to(logits.dtype)  # [V]
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    output_ids: Sequence[int],
    extra: Sequence[int],
    presence: float,
    frequency: float,
    eos_ids: list[int],
) -> torch.Tensor:
    """What every token choice (the target's, a draft's) applies before sampling: penalties over
    the tokens so far (`output_ids` then `extra`, e.g. tokens accepted earlier in a window) and
    the min_tokens EOS ban. The token history is only built when a penalty needs it."""
    if presence or frequency:
        logits = apply_penalties(logits, [*output_ids, *extra], presence, frequency)
    return ban_eos_before_min_tokens(logits, eos_ids, len(output_ids) + len(extra), params)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, top-k, top-p applied. [V] -> [V]."""
    return torch.softmax(filter_logits(logits, params), dim=-1)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index of [V] non-negative weights (at least one positive; they need not sum to 1), each
    with probability weight / sum: the inverse of the cumulative sum (in float64) at one uniform draw
    from `generator`. torch.multinomial draws from the same distribution, but its per-call setup makes
    one sample of a large vocabulary several times slower (docs/benchmarks/engine.md). A zero-weight
    index is never drawn: its cumulative sum equals its predecessor's, and searchsorted(right) returns
    the first index whose sum exceeds u."""
    c = weights.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=weights.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))  # the one host read
    if i < c.shape[0]:
        return i
    # u rounded up to the total (a uniform just below 1): the last index that has weight
    return int(torch.nonzero(weights > 0)[-1, 0])


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from [V] logits."""
    if params.greedy:
        return greedy_token(logits)
    return draw(target_probs(logits, params), generator)


def token_logprob(lp: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """The logprob of `token_id` and the top `k`. lp: [V] log-probabilities."""
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, idx = torch.topk(lp, min(k, lp.shape[-1]))
        top = [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return TokenLogprob(token_id, float(lp[token_id]), top)


def grammar_masked(
    logits: torch.Tensor, banned: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """`banned` (the [V] logits after penalties and the min_tokens EOS ban) with the tokens a grammar does
    not allow (`allowed`: [V] bool) set to -inf. The grammar outranks min_tokens: if only EOS may follow,
    the unbanned `logits` are masked instead."""
    masked = banned.masked_fill(~allowed, float("-inf"))
    return (
        masked
        if bool(torch.isfinite(masked).any())
        else logits.masked_fill(~allowed, float("-inf"))
    )
