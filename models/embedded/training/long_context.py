"""The long-context stage: the trained pair, fine-tuned on long windows into models/embedded/long/.

The pair's main stages train on 256-token windows, so the target has seen no distance beyond 255:
its loss on the test split climbs from 4.6 nats in the first 256 positions to 5.2-5.5 at 512-1024
and 6.1 at 3072-4096 (the draft, weaker to begin with, stays within 0.3 nats). This stage resumes
both models from models/embedded/{target,draft} with the context raised to --context, trains the
target on --seq-len windows (its routing balanced as in the last main phase), then distils the
draft from the new target on the same windows. The main pair is left as it is: every page measured
on it stays valid, and the long pair serves the experiments that need long generations.
"""

from __future__ import annotations

from typing import Any

import torch

from models.embedded.training.data import Batcher
from models.embedded.training.loop import train_one
from models.embedded.training.paths import (
    DRAFT_DIR,
    LONG_DRAFT_DIR,
    LONG_TARGET_DIR,
    TARGET_DIR,
)


def load_fp32(path: str, context: int, **kw: Any):
    """A model of the pair in float32 with its context (max_position_embeddings) set to `context`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    model.config.max_position_embeddings = context
    return model


def _batches(args, corpus, seed: int) -> Batcher:
    """--batch-size windows of --seq-len training tokens (chat rows mixed in), drawn from `seed`."""
    return Batcher(
        corpus.train_ids, corpus.pool, args.seq_len, args.batch_size, args.chat_frac, seed
    )


def train_long_pair(args, corpus, log: dict, make_regulariser) -> None:
    """Fine-tune the target, then the draft, on --seq-len windows with the context set to --context;
    both saved into models/embedded/long/ (log keys `long_target`, `long_draft`)."""
    if args.seq_len > args.context:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds --context {args.context}")
    torch.manual_seed(args.seed)
    target = load_fp32(TARGET_DIR, args.context, experts_implementation=args.experts_impl)
    target.config.router_aux_loss_coef = args.aux_coef
    log["long_target"] = {"argv": args.argv, "context": args.context, "from": "target"}
    batch = _batches(args, corpus, args.seed + 11)
    train_one(
        "long_target",
        target,
        args,
        corpus.tok,
        batch,
        corpus.valid_batches,
        log,
        LONG_TARGET_DIR,
        args.long_target_steps,
        None,
        args.long_target_lr,
        regulariser=make_regulariser(args, target.config, target),
    )
    target.eval()
    draft = load_fp32(DRAFT_DIR, args.context)
    log["long_draft"] = {"argv": args.argv, "context": args.context, "from": "draft"}
    batch = _batches(args, corpus, args.seed + 12)
    train_one(
        "long_draft",
        draft,
        args,
        corpus.tok,
        batch,
        corpus.valid_batches,
        log,
        LONG_DRAFT_DIR,
        args.long_draft_steps,
        None,
        args.long_draft_lr,
        teacher=target,
    )
