"""Training data: the corpus as token streams, synthetic chats, batchers and sequence-KD rows."""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from models.embedded.training.paths import DATA, DOC_SEP, EOS_ID, PAD_ID, TARGET_DIR


def ensure_corpus():
    need = [os.path.join(DATA, "train.txt"), os.path.join(TARGET_DIR, "tokenizer.json")]
    if not all(os.path.exists(p) for p in need):
        from models.embedded import build_corpus

        build_corpus.main([])


def load_stream(tok, path, cache=None):
    tok_file = os.path.join(TARGET_DIR, "tokenizer.json")
    if (
        cache
        and os.path.exists(cache)
        and os.path.getmtime(cache) > max(os.path.getmtime(path), os.path.getmtime(tok_file))
    ):
        return np.load(cache)  # newer than both the text and the tokenizer that encoded it
    docs = [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d.strip()]
    ids = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(EOS_ID)
    arr = np.asarray(ids, dtype=np.int32)
    if cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        np.save(cache, arr)
    return arr


def build_chat_pool(tok, path, n, seed, n_shakes_docs):
    """Synthetic single-turn chats: user asks to continue a passage, assistant continues it."""
    rng = random.Random(seed)
    docs = [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d.strip()]
    pool = []
    prompts_a = [
        "Continue the scene:\n{c}",
        "Continue this passage from the play:\n{c}",
        "Write the next lines.\n{c}",
    ]
    prompts_b = [
        "Continue this passage from the Python documentation:\n{c}",
        "Explain further:\n{c}",
        "Continue the text:\n{c}",
    ]
    bare_a = [
        "Continue the scene.",
        "Write a short scene.",
        "Say something in the style of Shakespeare.",
    ]
    bare_b = [
        "Tell me about Python.",
        "Explain a Python module.",
        "Write some Python documentation.",
    ]
    while len(pool) < n:
        di = rng.randrange(len(docs))
        shakes = di < n_shakes_docs
        paras = [p for p in docs[di].split("\n\n") if p.strip()]
        if len(paras) < 3:
            continue
        i = rng.randrange(len(paras) - 2)
        ctx = paras[i][:300]
        resp, j = "", i + 1
        while j < len(paras) and len(resp) < 500:
            resp += ("\n\n" if resp else "") + paras[j]
            j += 1
        if rng.random() < 0.25:
            user = rng.choice(bare_a if shakes else bare_b)
        else:
            user = rng.choice(prompts_a if shakes else prompts_b).format(c=ctx)
        text = (
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{resp[:800]}<|im_end|>\n"
        )
        ids = tok(text, add_special_tokens=False)["input_ids"] + [EOS_ID]
        pool.append(np.asarray(ids, dtype=np.int32))
    return pool


class Batcher:
    def __init__(self, stream, chat_pool, seq_len, batch, chat_frac, seed):
        self.s, self.pool, self.T, self.B, self.cf = stream, chat_pool, seq_len, batch, chat_frac
        self.rng = np.random.default_rng(seed)

    def next(self):
        out = np.empty((self.B, self.T + 1), dtype=np.int64)
        for b in range(self.B):
            off = self.rng.integers(0, len(self.s) - self.T - 1)
            row = self.s[off : off + self.T + 1]
            if self.pool and self.rng.random() < self.cf:
                c = self.pool[self.rng.integers(len(self.pool))][: self.T + 1]
                row = np.concatenate([c, row[: self.T + 1 - len(c)]])
            out[b] = row
        x = torch.from_numpy(out)
        return x[:, :-1], x[:, 1:]


@torch.no_grad()
def target_continuations(
    teacher, stream, n, prompt_len, length, batch, seed
) -> tuple[np.ndarray, float]:
    """Sequence-level distillation data (Kim & Rush 2016): `prompt_len` training tokens followed by the
    target's own greedy continuation, `length` tokens per row.  Speculative decoding accepts a draft
    token only when it equals the target's greedy choice, so these rows show the draft exactly the
    behaviour it is scored on, including the target's habit of falling into repetition loops.
    Returns the (n, length) rows and the seconds spent generating them."""
    rng = np.random.default_rng(seed)
    offs = rng.integers(0, len(stream) - prompt_len - 1, size=n)
    out = np.empty((n, length), dtype=np.int64)
    t0 = time.time()
    for i in tqdm(range(0, n, batch), desc="seq-KD data", mininterval=10, file=sys.stdout):
        x = torch.from_numpy(
            np.stack([stream[o : o + prompt_len] for o in offs[i : i + batch]]).astype(np.int64)
        )
        g = teacher.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=length - prompt_len,
            min_new_tokens=length - prompt_len,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
        out[i : i + len(x)] = g[:, :length].numpy()
    secs = time.time() - t0
    print(f"seq-KD: {n} target continuations in {secs / 60:.1f} min", flush=True)
    return out, secs


class MixBatcher:
    """Replaces a fraction of the rows of another batcher's batches with seq-KD rows."""

    def __init__(self, base: Batcher, rows: np.ndarray, frac: float, seed: int):
        self.base, self.rows, self.frac = base, np.asarray(rows), frac
        self.rng = np.random.default_rng(seed)

    def next(self):
        x, y = self.base.next()
        full = torch.cat([x, y[:, -1:]], dim=1)
        for b in range(full.size(0)):
            if self.rng.random() < self.frac:
                full[b] = torch.from_numpy(self.rows[self.rng.integers(len(self.rows))])
        return full[:, :-1], full[:, 1:]


def fixed_eval_batches(stream, seq_len, n_seqs, batch):
    """Deterministic non-overlapping windows spread over the split."""
    n_avail = (len(stream) - 1) // seq_len
    idx = np.linspace(0, n_avail - 1, num=min(n_seqs, n_avail)).astype(int)
    rows = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int64)
    t = torch.from_numpy(rows)
    return [(t[i : i + batch, :-1], t[i : i + batch, 1:]) for i in range(0, len(t), batch)]
