"""Greedy decoding of the embedded pair without a KV cache: the next token, speculative
decoding (draft proposes, target verifies) and plain generation."""

from __future__ import annotations

import torch

from models.embedded.training.paths import EOS_ID, IM_END_ID

EOS_IDS = {EOS_ID, IM_END_ID}


@torch.no_grad()
def greedy_next(model, ids):
    return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())


@torch.no_grad()
def speculative(target, draft, prompt, new_tokens, k):
    """Greedy speculative decoding without KV cache (exactness > speed here)."""
    ids = list(prompt)
    rounds, accepted_total, produced = 0, 0, 0
    while produced < new_tokens:
        prop = []
        cur = list(ids)
        for _ in range(k):
            t = greedy_next(draft, cur)
            prop.append(t)
            cur.append(t)
        logits = target(input_ids=torch.tensor([ids + prop])).logits[0]
        tgt = logits[len(ids) - 1 :].argmax(-1).tolist()  # k+1 target greedy tokens
        a = 0
        while a < k and prop[a] == tgt[a]:
            a += 1
        new = prop[:a] + [tgt[a]]
        rounds += 1
        accepted_total += a
        produced += len(new)
        ids += new
        if any(t in EOS_IDS for t in new):
            break
    return {
        "rounds": rounds,
        "accepted": accepted_total,
        "produced": produced,
        "ids": ids[len(prompt) :],
    }


@torch.no_grad()
def generate(model, tok, ids, n):
    out = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
    )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=False)
