"""The flags of `python -m models.embedded.train`, added in four parts (in the order --help has always
listed them, which is not grouped by topic)."""

from __future__ import annotations

import argparse

from models.embedded.training.paths import LOG_JSON


def build_parser(description: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_calibration_run_and_arch_flags(ap)
    _add_shape_and_balance_flags(ap)
    _add_locality_resume_and_schedule_flags(ap)
    _add_optimiser_draft_and_output_flags(ap)
    _add_long_context_flags(ap)
    ap.set_defaults(log_json=LOG_JSON)  # where train_one writes the log (the long stage: its own)
    return ap


def recorded_args(args: argparse.Namespace) -> dict:
    """The arguments as the training log keeps them: without where the log itself goes (a path
    of this machine)."""
    return {k: v for k, v in vars(args).items() if k != "log_json"}


def _add_long_context_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--context",
        type=int,
        default=4096,
        help="--stage long: the long pair's context (max_position_embeddings; default 4096)",
    )
    ap.add_argument(
        "--long-target-steps",
        type=int,
        default=250,
        help="--stage long: optimiser steps of the target (default 250)",
    )
    ap.add_argument(
        "--long-target-lr",
        type=float,
        default=1e-3,
        help="--stage long: peak learning rate of the target (default 1e-3)",
    )
    ap.add_argument(
        "--long-draft-steps",
        type=int,
        default=150,
        help="--stage long: optimiser steps of the draft, distilled from the long target (default 150)",
    )
    ap.add_argument(
        "--long-draft-lr",
        type=float,
        default=2e-3,
        help="--stage long: peak learning rate of the draft (default 2e-3)",
    )


def _add_calibration_run_and_arch_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--calibrate-iters",
        type=int,
        default=0,
        help="glm4_moe: after the target trains (or alone with --stage calibrate), re-estimate the "
        "balancing bias on training text for this many iterations, weights frozen (0 = off)",
    )
    ap.add_argument(
        "--calibrate-batches",
        type=int,
        default=8,
        help="training batches routed per calibration iteration",
    )
    ap.add_argument(
        "--calibrate-rate",
        type=float,
        default=0.02,
        help="bias step per unit of relative share error",
    )
    ap.add_argument(
        "--stage",
        choices=["both", "target", "draft", "calibrate", "long"],
        default="both",
        help="train target then draft (both), or only one; 'draft' loads the saved target as teacher; "
        "'long' fine-tunes the saved pair on --seq-len windows into models/embedded/long/",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed for init, batch sampling and chat synthesis"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch.set_num_threads value (2 on an idle 2-core box; use 1 when the CPU is shared: oversubscribed OpenMP barriers made 2 threads 2x slower here)",
    )
    ap.add_argument("--seq-len", type=int, default=256, help="training sequence length in tokens")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per optimiser step")
    ap.add_argument(
        "--bias-rate",
        type=float,
        default=1e-3,
        help="glm4_moe: per-step change of the auxiliary-loss-free balancing bias (DeepSeek-V3's 0.001)",
    )
    ap.add_argument(
        "--bias-update",
        choices=["sign", "proportional"],
        default="sign",
        help="glm4_moe: bias step = rate x sign(share error) (DeepSeek-V3) or rate x relative share error "
        "(clipped to [-8, 1]): over-chosen experts are pulled back in proportion",
    )
    ap.add_argument(
        "--router-z-coef",
        type=float,
        default=0.0,
        help="glm4_moe: coefficient of the router z-loss, mean(logit^2), which keeps sigmoid scores graded",
    )
    ap.add_argument(
        "--sticky-cap", type=float, default=10.0, help="upper bound of the locality coefficient"
    )
    ap.add_argument(
        "--arch",
        choices=["glm4_moe", "qwen2_moe", "qwen3_moe"],
        default="glm4_moe",
        help="target architecture: glm4_moe = v2, the shipped one (DeepSeek-V3-style sigmoid router with "
        "bias balancing, shared expert, fine-grained routed experts; the default); qwen2_moe = the "
        "same shape with a softmax router and a balance loss (tried first, see the model card); "
        "qwen3_moe = v1 (use with --num-experts 64 --moe-intermediate 64 --balance micro)",
    )
    ap.add_argument(
        "--layers", type=int, default=4, help="target decoder layers (every one is a MoE layer)"
    )


def _add_shape_and_balance_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--num-experts", type=int, default=128, help="routed experts per MoE layer of the target"
    )
    ap.add_argument(
        "--top-k", type=int, default=8, help="routed experts per token of the MoE target"
    )
    ap.add_argument(
        "--moe-intermediate", type=int, default=32, help="intermediate size of one routed expert"
    )
    ap.add_argument(
        "--shared-intermediate",
        type=int,
        default=256,
        help="intermediate size of the always-on shared expert (glm4_moe: a multiple of --moe-intermediate)",
    )
    ap.add_argument(
        "--experts-impl",
        choices=["grouped_mm", "eager"],
        default="grouped_mm",
        help="transformers experts kernel used while training: grouped_mm runs all experts of a layer in "
        "one grouped matmul (about 1.6x faster per step here than eager's per-expert loop, same "
        "numbers); the checkpoint is the same either way",
    )
    ap.add_argument(
        "--balance",
        choices=["global", "micro", "pooled"],
        default="global",
        help="load balancing: global = Qwen3-style global-batch Switch loss with expert counts over "
        "--balance-window steps of sequences (v2); micro = v1's per-layer Switch loss over each "
        "micro-batch; pooled = transformers' loss with counts pooled over layers (v1's first 200 steps)",
    )
    ap.add_argument(
        "--balance-window",
        type=int,
        default=1,
        help="global balancing: steps whose routing counts form the global batch (x --batch-size sequences). "
        "1 = the whole optimiser batch. Counts of earlier steps are stale (the router has moved since), "
        "and with 8 steps the balance oscillated and left ~40 of 128 experts per layer starved",
    )
    ap.add_argument(
        "--balance-guard",
        type=float,
        default=0.35,
        help="global balancing: raise a layer's balance coefficient while its least-used expert in the "
        "window is below this fraction of the uniform share (0 = fixed coefficient)",
    )
    ap.add_argument(
        "--select-coef",
        type=float,
        default=0.0,
        help="global balancing: weight of the soft top-k selection-balancing term (0 = off; with it on, "
        "layers 1-3 collapsed onto ~8 experts in a 45-step check, so it is off by default)",
    )
    ap.add_argument(
        "--revive-coef",
        type=float,
        default=0.0,
        help="global balancing: coefficient of -log(router probability) of experts under --balance-guard",
    )
    ap.add_argument(
        "--sticky-target",
        type=float,
        default=0.5,
        help="global balancing: consecutive-token overlap of selected experts the locality controller "
        "aims at (0 = no locality term)",
    )
    ap.add_argument(
        "--sticky-coef", type=float, default=0.01, help="initial coefficient of the locality term"
    )
    ap.add_argument(
        "--sticky-floor", type=float, default=1e-4, help="lower bound of the locality coefficient"
    )


def _add_locality_resume_and_schedule_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--balance-init",
        type=float,
        default=0.0,
        help="starting balance coefficient (e.g. where phase 1 of a resumed run left the guard)",
    )
    ap.add_argument(
        "--sticky-no-yield",
        action="store_true",
        help="let the locality coefficient grow even while a layer has a starved expert (the balance guard "
        "still raises the balance coefficient); by default locality yields to balance",
    )
    ap.add_argument(
        "--stop-after",
        type=int,
        default=0,
        metavar="STEP",
        help="save and stop after this step without shortening the schedule (phase 1 of a resumed run)",
    )
    ap.add_argument(
        "--target-resume",
        type=int,
        default=0,
        metavar="STEP",
        help="continue the target from the checkpoint in models/embedded/target/ saved at STEP "
        "(fresh optimiser, warm-up again; curve kept from train_log.json)",
    )
    ap.add_argument(
        "--aux-coef",
        type=float,
        default=0.1,
        help="router load-balancing loss coefficient (global: floor of the guarded coefficient, loss "
        "normalised to 1 at balance; micro/pooled: v1's loss, top_k at balance)",
    )
    # Step counts by default, so a rerun with the same seed is step-exact (about 40 + 15 min at 1 thread here);
    # 0 switches to the wall-clock budgets below, whose step count depends on the machine's speed.
    ap.add_argument(
        "--target-steps",
        type=int,
        default=800,
        help="target optimiser steps (default 800, about 36 min at 1 thread here; 0 = size from --target-minutes)",
    )
    ap.add_argument(
        "--target-minutes",
        type=float,
        default=42.0,
        help="wall-clock budget for the target when --target-steps is 0",
    )
    ap.add_argument(
        "--draft-steps",
        type=int,
        default=240,
        help="draft optimiser steps (default 240; 0 = size from --draft-minutes)",
    )
    ap.add_argument(
        "--draft-minutes",
        type=float,
        default=18.0,
        help="wall-clock budget for the draft when --draft-steps is 0",
    )
    ap.add_argument(
        "--target-lr", type=float, default=3e-3, help="peak AdamW learning rate of the target"
    )
    ap.add_argument(
        "--draft-lr", type=float, default=4e-3, help="peak AdamW learning rate of the draft"
    )
    ap.add_argument(
        "--warmup", type=int, default=50, help="linear warm-up steps (then cosine to 10%%)"
    )
    ap.add_argument(
        "--weight-decay", type=float, default=0.05, help="AdamW weight decay on matrices"
    )


def _add_optimiser_draft_and_output_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    ap.add_argument(
        "--chat-frac",
        type=float,
        default=0.05,
        help="fraction of training rows that are synthetic chats",
    )
    ap.add_argument(
        "--distill-alpha",
        type=float,
        default=0.7,
        help="draft loss = (1-a)*CE + a*KL(target||draft); 0 disables distillation",
    )
    ap.add_argument(
        "--distill-temp", type=float, default=1.0, help="distillation softmax temperature"
    )
    ap.add_argument(
        "--seqkd-seqs",
        type=int,
        default=0,
        help="draft: number of target greedy continuations generated for sequence-level distillation "
        "(0 = none, as in v1)",
    )
    ap.add_argument(
        "--seqkd-prompt",
        type=int,
        default=32,
        help="draft: training-split prompt tokens of each seq-KD row",
    )
    ap.add_argument(
        "--seqkd-frac",
        type=float,
        default=0.5,
        help="draft: fraction of training rows taken from seq-KD rows",
    )
    ap.add_argument("--seqkd-batch", type=int, default=64, help="draft: prompts generated together")
    ap.add_argument(
        "--eval-every", type=int, default=100, help="steps between validation evaluations"
    )
    ap.add_argument(
        "--valid-seqs", type=int, default=48, help="fixed validation windows used for the curve"
    )
    ap.add_argument("--save-every", type=int, default=200, help="steps between checkpoint saves")
    ap.add_argument(
        "--bench-steps", type=int, default=5, help="steps timed to size a minute budget"
    )
    ap.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw docs/embedded_loss.png from train_log.json and exit",
    )
