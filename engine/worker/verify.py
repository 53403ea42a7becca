"""Accepting proposed tokens so that the output is exactly what the target alone would emit.

A window is [last token, d_1 .. d_k]: the target's logits at row i predict the token after
row i, so row i checks proposal d_{i+1}, and row k (after the last proposal) gives a bonus
token when every proposal is accepted.

- Greedy: accept d_{i+1} while it is the target's argmax; the first mismatch is replaced by
  the argmax, which is exactly the token plain greedy decoding emits there.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): with target distribution p and the
  proposer's q, accept d with probability min(1, p(d) / q(d)); on rejection, draw from the
  residual max(p - q, 0), renormalized. The emitted token then follows p exactly. A proposer
  without distributions (n-gram, the tests' fake proposer) is a point mass: q(d) = 1, so d
  is accepted with probability p(d) and the residual is p with d removed.
p comes from the same processing as plain sampling (penalties, min_tokens EOS ban,
temperature, top-k, top-p), applied per row with the tokens accepted before it, so it is a
valid distribution whatever the logits hold (engine/worker/sampling.py).
- Seeded sampling (a request with a `seed`): each row draws the target's own token by a race of
  the seed's and the row position's random draws (`seeded_draw`), and a proposal is accepted only
  where it equals that token. The output is then exactly plain seeded sampling's, token for
  token, with or without speculation and whatever shares the step. The draft proposes by the same
  race (engine/speculative/draft.py), so a proposal matches with probability at least
  (1 - d) / (1 + d), d the total variation between the two distributions, against
  1 - d for the rule above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.worker.sampling import (
    SamplingParams,
    draw,
    greedy_token,
    sample,
    seeded_draw,
    target_probs,
)


def verify_window(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    process: Callable[[torch.Tensor, list[int]], torch.Tensor],
    draft_probs: torch.Tensor | None = None,
    first_position: int | None = None,
) -> list[int]:
    """logits: [k+1, V] target rows for a window with k proposals. process(row_logits,
    accepted_so_far) applies penalties and bans. first_position: the sequence position of the
    first row (seeded requests draw by position). Returns the emitted tokens: the accepted
    proposals, then one corrected or bonus token (1..k+1 tokens)."""
    out: list[int] = []
    if params.seed is not None and not params.greedy and first_position is not None:
        for i in range(len(drafts) + 1):
            p = target_probs(process(logits[i], out), params)
            out.append(seeded_draw(p, params.seed, first_position + i))
            if i == len(drafts) or out[-1] != drafts[i]:
                return out
    for i, d in enumerate(drafts):
        row = process(logits[i], out)
        if params.greedy:
            best = greedy_token(row)
            out.append(best)
            if best != d:
                return out
            continue
        p = target_probs(row, params)  # [V]
        q = _distribution(draft_probs[i]) if draft_probs is not None else None  # [V]
        q_d = float(q[d]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0) if q is not None else p.clone()
        if q is None:
            residual[d] = 0.0
        if not float(residual.sum()) > 0:  # p == q: any rejection left nothing; p itself is exact
            residual = p
        out.append(draw(residual, generator))
        return out
    out.append(sample(process(logits[len(drafts)], out), params, generator))
    return out


def _distribution(q: torch.Tensor) -> torch.Tensor | None:
    """A proposer's row [V] if it is a distribution; None (a point mass on the proposal) if it
    holds NaN, inf or negative entries: a broken draft then costs acceptance, never the request."""
    q = q.float()
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()) or not float(q.sum()) > 0:
        return None
    return q
