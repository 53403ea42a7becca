"""The test split as token ids and windows, and perplexity over them."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from models.embedded.training.paths import DOC_SEP


def load_ids(tok, path):
    docs = [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d.strip()]
    ids = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(0)
    return np.asarray(ids, dtype=np.int64)


def windows(ids, T):
    n = (len(ids) - 1) // T
    return [torch.from_numpy(ids[i * T : i * T + T + 1]) for i in range(n)]


@torch.no_grad()
def perplexity(model, wins, batch):
    tot, n = 0.0, 0
    for i in range(0, len(wins), batch):
        x = torch.stack(wins[i : i + batch])
        logits = model(input_ids=x[:, :-1]).logits.float()
        tot += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        ).item()
        n += x[:, 1:].numel()
    return {"nll": tot / n, "ppl": math.exp(tot / n), "tokens": n}
