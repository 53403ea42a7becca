"""Train the embedded default model pair (Qwen3-MoE target + dense Qwen3 draft) on the corpus
built by ``models/embedded/build_corpus.py``.

One command:   python -m models.embedded.train          (rebuilds the corpus/tokenizer if missing)

Stage 1 trains the MoE target with next-token cross entropy + the router load-balancing aux loss.
Stage 2 trains the dense draft with a mix of cross entropy and KL distillation from the trained
target's logits.  Weights (bf16 safetensors), generation_config.json and tokenizer files are saved
into models/embedded/target/ and models/embedded/draft/ every --save-every steps and at the end, so a
partial run leaves usable weights.  Loss curves go to docs/embedded_loss.png, raw numbers to
models/embedded/train_log.json.

The number of optimiser steps is either given (--target-steps / --draft-steps) or derived from a
wall-clock budget (--target-minutes / --draft-minutes): the script times a few warm-up steps and
sizes the cosine schedule to fit.  Batches are sampled with a fixed seed; only the step count
depends on measured speed when a minute budget is used (the chosen counts are logged).
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models.embedded.training.args import build_parser, recorded_args
from models.embedded.training.balance import BiasBalancer, RoutingRegulariser, calibrate_bias
from models.embedded.training.checkpoints import save_model, write_log
from models.embedded.training.configs import active_params, draft_config, target_config
from models.embedded.training.data import (
    Batcher,
    MixBatcher,
    build_chat_pool,
    ensure_corpus,
    fixed_eval_batches,
    load_stream,
    target_continuations,
)
from models.embedded.training.long_context import train_long_pair
from models.embedded.training.loop import train_one
from models.embedded.training.paths import (
    DATA,
    DRAFT_DIR,
    HERE,
    LOG_JSON,
    LONG_LOG_JSON,
    TARGET_DIR,
)


@dataclass
class Corpus:
    """The token streams and chat pool every stage samples from."""

    tok: Any
    train_ids: np.ndarray
    valid_ids: np.ndarray
    pool: list[np.ndarray]
    valid_batches: list[Any]


def main(argv=None):
    args = build_parser(__doc__).parse_args(argv)
    if args.plot_only:
        write_log(json.load(open(LOG_JSON)))
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    ensure_corpus()
    corpus = load_corpus(args)
    resume = args.target_resume and args.stage in ("both", "target")
    argv_list = list(argv if argv is not None else sys.argv[1:])
    if args.stage == "long":  # its own log beside the long pair; the main pair's log is not touched
        os.makedirs(os.path.dirname(LONG_LOG_JSON), exist_ok=True)
        args.argv, args.log_json = argv_list, LONG_LOG_JSON
        train_long_pair(args, corpus, {"args": recorded_args(args)}, make_regulariser)
        print("done", flush=True)
        return
    log = start_log(args, resume, corpus)

    tcfg, dcfg = target_config(args), draft_config(args)
    ta, da = active_params(tcfg), active_params(dcfg)
    ratio = da["flops_per_token"] / ta["flops_per_token"]
    print(
        f"active FLOPs/token target {ta['flops_per_token']:,} draft {da['flops_per_token']:,} ratio {ratio:.4f}"
    )
    assert ratio <= 1 / 8, "draft exceeds 1/8 of target active FLOPs"

    target = None
    if args.stage in ("both", "target"):
        target = train_target(args, argv_list, corpus, log, tcfg, resume)
    if args.calibrate_iters and args.stage in ("both", "target", "calibrate"):
        calibrate(args, argv_list, corpus, log, target)
    if args.stage in ("both", "draft"):
        train_draft(args, argv_list, corpus, log, dcfg)
    print("done", flush=True)


def load_corpus(args) -> Corpus:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    # Token ids of the training split, cached beside the data (git-ignored) for reruns.
    train_ids = load_stream(
        tok, os.path.join(DATA, "train.txt"), cache=os.path.join(HERE, ".cache", "train_ids.npy")
    )
    valid_ids = load_stream(tok, os.path.join(DATA, "valid.txt"))
    stats = json.load(open(os.path.join(HERE, "corpus_stats.json")))
    pool = build_chat_pool(
        tok,
        os.path.join(DATA, "train.txt"),
        4000,
        args.seed,
        stats["documents"]["shakespeare"]["train"],
    )
    valid_batches = fixed_eval_batches(valid_ids, args.seq_len, args.valid_seqs, args.batch_size)
    print(
        f"train tokens {len(train_ids)}  valid tokens {len(valid_ids)}  chat pool {len(pool)}",
        flush=True,
    )
    return Corpus(tok, train_ids, valid_ids, pool, valid_batches)


def start_log(args, resume, corpus: Corpus) -> dict:
    """The training log: the earlier one where a stage is trained alone or resumed, else a new one."""
    log = (
        json.load(open(LOG_JSON))
        if os.path.exists(LOG_JSON) and (args.stage != "both" or resume)
        else {}
    )
    if resume and isinstance(
        log.get("target"), dict
    ):  # keep how the earlier phases were run, in order
        t = log["target"]
        t["phases"] = (t.get("phases") or ([t["phase1_argv"]] if t.get("phase1_argv") else [])) + [
            t.get("argv")
        ]
        t["phase1_argv"] = t["phases"][0]
    log["args"] = recorded_args(args)
    log["train_tokens"] = int(len(corpus.train_ids))
    return log


def load_target(args):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        TARGET_DIR, dtype=torch.float32, experts_implementation=args.experts_impl
    )


def train_target(args, argv_list, corpus: Corpus, log: dict, tcfg, resume):
    """Stage 1: the MoE target, from scratch or resumed from its checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    if resume:
        target = load_target(args)
        target.config.router_aux_loss_coef = args.aux_coef
    else:
        tcfg.experts_implementation = args.experts_impl
        target = AutoModelForCausalLM.from_config(tcfg)
        log["target"] = {}
    n = sum(p.numel() for p in target.parameters())
    log["target"]["desc"] = (
        f"{args.arch} {n / 1e6:.2f}M params, {args.num_experts} experts top-{args.top_k}"
        + (f" + shared expert, {args.balance}-batch balancing" if args.arch == "qwen2_moe" else "")
        + (" + shared expert, aux-loss-free bias balancing" if args.arch == "glm4_moe" else "")
    )
    log["target"]["argv"] = argv_list
    # the model card reads the target's own settings from here
    log["target"]["args"] = recorded_args(args)
    print(f"target params {n:,}", flush=True)
    batcher = Batcher(
        corpus.train_ids,
        corpus.pool,
        args.seq_len,
        args.batch_size,
        args.chat_frac,
        args.seed + 1 + args.target_resume,
    )
    train_one(
        "target",
        target,
        args,
        corpus.tok,
        batcher,
        corpus.valid_batches,
        log,
        TARGET_DIR,
        args.target_steps,
        args.target_minutes,
        args.target_lr,
        start_step=args.target_resume,
        regulariser=make_regulariser(args, tcfg, target),
    )
    return target


def make_regulariser(args, tcfg, target):
    """The router balancing of this recipe: bias balancing (glm4_moe), the global-batch regulariser,
    or None (v1's losses, computed in the step)."""
    if args.arch == "glm4_moe":
        return BiasBalancer(
            target,
            args.bias_rate,
            args.sticky_target,
            args.sticky_coef,
            args.sticky_floor,
            args.sticky_cap,
            update=args.bias_update,
            z_coef=args.router_z_coef,
        )
    if args.balance == "global":
        return RoutingRegulariser(
            tcfg.num_hidden_layers,
            tcfg.num_experts,
            tcfg.num_experts_per_tok,
            "global",
            args.aux_coef,
            args.balance_window,
            args.sticky_target,
            args.sticky_coef,
            args.balance_guard,
            args.revive_coef,
            0,
            args.select_coef,
            args.sticky_floor,
            not args.sticky_no_yield,
            args.balance_init,
        )
    return None


def calibrate(args, argv_list, corpus: Corpus, log: dict, target) -> None:
    """Settle the target's balancing bias with its weights frozen, then save it."""
    model = target if args.stage != "calibrate" else load_target(args)
    model.eval()
    hist = calibrate_bias(
        model,
        Batcher(
            corpus.train_ids,
            corpus.pool,
            args.seq_len,
            args.batch_size,
            args.chat_frac,
            args.seed + 5,
        ),
        args.calibrate_iters,
        args.calibrate_batches,
        args.calibrate_rate,
    )
    print(
        f"calibration: experts under 1/4 share per layer {hist[0]['experts_below_quarter_share']} -> "
        f"{hist[-1]['experts_below_quarter_share']}",
        flush=True,
    )
    log.setdefault("target", {})["calibration"] = {
        "argv": argv_list,
        "iters": args.calibrate_iters,
        "batches": args.calibrate_batches,
        "rate": args.calibrate_rate,
        "history": hist,
    }
    save_model(model, TARGET_DIR, corpus.tok)
    write_log(log)


def train_draft(args, argv_list, corpus: Corpus, log: dict, dcfg) -> None:
    """Stage 2: the dense draft, distilled from the trained target where asked."""
    from transformers import Qwen3ForCausalLM

    teacher = None
    if args.distill_alpha > 0 or args.seqkd_seqs:
        teacher = load_target(args)
        teacher.config.output_router_logits = False
        teacher.eval()
    batcher: Batcher | MixBatcher = Batcher(
        corpus.train_ids, corpus.pool, args.seq_len, args.batch_size, args.chat_frac, args.seed + 2
    )
    seqkd_info = None
    if args.seqkd_seqs:
        rows, secs = target_continuations(
            teacher,
            corpus.train_ids,
            args.seqkd_seqs,
            args.seqkd_prompt,
            args.seq_len + 1,
            args.seqkd_batch,
            args.seed + 3,
        )
        batcher = MixBatcher(batcher, rows, args.seqkd_frac, args.seed + 4)
        seqkd_info = {
            "sequences": len(rows),
            "prompt_tokens": args.seqkd_prompt,
            "frac": args.seqkd_frac,
            "seconds": secs,
        }
    if args.distill_alpha <= 0:
        teacher = None
    torch.manual_seed(args.seed + 7)
    draft = Qwen3ForCausalLM(dcfg)
    n = sum(p.numel() for p in draft.parameters())
    log["draft"] = {
        "desc": f"dense Qwen3 {n / 1e6:.2f}M params"
        + (", distilled" if teacher else "")
        + (", seq-KD" if seqkd_info else ""),
        "seqkd": seqkd_info,
    }
    log["draft"]["argv"] = argv_list
    print(f"draft params {n:,}", flush=True)
    train_one(
        "draft",
        draft,
        args,
        corpus.tok,
        batcher,
        corpus.valid_batches,
        log,
        DRAFT_DIR,
        args.draft_steps,
        args.draft_minutes,
        args.draft_lr,
        teacher=teacher,
    )


if __name__ == "__main__":
    main()
