"""The model card's training sections: the Card every section reads, the loss row, and how the
target was trained to route (bias balancing for glm4_moe, global-batch balancing for qwen2_moe)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Card:
    """What every section reads: the results, the models' configs and the training settings."""

    res: dict
    target: Any
    draft: Any
    a: dict  # the last training stage's arguments
    ta: dict  # the target stage's own arguments
    bal: str  # how the target balanced its routing: bias, global, micro or pooled

    @property
    def tr(self) -> dict:
        return self.res["training"]


def mins(x):
    return f"{x / 60:.1f} min" if x else "n/a"


def loss_and_training(x: Card) -> list[str]:
    """The loss row of the models table and how both were trained."""
    tc, tr, ta, bal = x.target.config, x.tr, x.ta, x.bal
    L: list[str] = []
    if bal == "bias":
        aux_txt = (
            f"CE + consecutive-token locality term (controller target overlap {ta.get('sticky_target')}, "
            f"coefficient ≤ {ta.get('sticky_cap')}); balance by DeepSeek-V3's auxiliary-loss-free bias "
            f"(updated from the counts of each step's {ta.get('batch_size')} sequences), no balance loss; "
            "see below"
        )
    elif bal == "global":
        aux_txt = (
            f"CE + global-batch load balancing (counts over {ta.get('balance_window')} steps × "
            f"{ta.get('batch_size')} sequences, coefficient ≥ {ta.get('aux_coef')}, guarded) + consecutive-token "
            f"locality term (controller target overlap {ta.get('sticky_target')}); see below"
        )
    else:
        aux_txt = (
            f"CE + {tc.router_aux_loss_coef} × per-micro-batch load-balancing aux loss ({bal})"
        )
    sk = tr["draft"].get("seqkd")
    draft_loss = (
        f"{1 - (ta.get('distill_alpha') or 0):.1f} × CE + {ta.get('distill_alpha')} × KL(target ‖ draft) "
        "distillation"
        + (
            f"; {100 * sk['frac']:.0f}% of rows are target greedy continuations "
            f"(sequence-level KD, {sk['sequences']} rows)"
            if sk
            else ""
        )
    )
    L.append(f"| loss | {aux_txt} | {draft_loss} |\n")
    L.append(
        "Training: AdamW (β=0.9/0.95, wd 0.05 on matrices), linear warm-up then cosine to 10% of peak, grad clip 1, "
        f"batch {ta.get('batch_size')} x {ta.get('seq_len')} tokens, fp32 on {ta.get('threads')} CPU thread(s), fixed seed; "
        "the target trains with transformers' `grouped_mm` experts kernel (same checkpoint, about 1.6× faster per "
        "step here than the per-expert loop); loss curves in `docs/embedded_loss.png`, raw numbers in "
        "`train_log.json`.\n"
    )
    L.append("![loss curves](../../docs/embedded_loss.png)\n")
    return L


def bias_story(x: Card) -> list[str]:
    """How a bias-balanced (glm4_moe) target was trained to route, phase by phase."""
    tr, ta, bal = x.tr, x.ta, x.bal
    L: list[str] = []
    if bal == "bias":
        L.append(
            "**How the v2 target is trained to route** (`BiasBalancer` in `training/balance.py`; the checkpoint is a plain "
            "`glm4_moe`, whose router is DeepSeek-V3's: sigmoid scores, top-k chosen on score + "
            "`e_score_correction_bias`, gates = the chosen scores renormalised):\n\n"
            "1. *Auxiliary-loss-free balancing* (DeepSeek-V3): after every optimiser step each layer's bias moves "
            f"up for experts chosen less than the mean over all {ta.get('batch_size')} sequences of the step (the "
            "global batch on one process) and down for those chosen more. The bias only changes which experts "
            "are chosen, not the gates, so cross entropy never pays for balance, and since the counts are global "
            "a text may keep to the experts of its domain.\n"
            "2. *Temporal locality*: −log of the normalised router score mass token t puts on the experts token "
            "t−1 chose, with a per-layer coefficient steered multiplicatively towards a consecutive-token overlap "
            f"of {ta.get('sticky_target')} and capped at {ta.get('sticky_cap')}. This is an explicit training "
            "pressure, stated so that nobody mistakes the locality for an emergent property; coefficients, "
            "overlaps and starved-expert counts per step are in `train_log.json` (`target.routing`).\n\n"
            "**Four phases, and why** (each resumed from the previous phase's last checkpoint with a fresh "
            "optimiser and a short warm-up; the command lines, in order, are in the rebuild section; losses, "
            "overlaps, starved-expert counts and router z per step are in `train_log.json`):\n\n"
            "* steps 0–599, DeepSeek-V3's update: ± 0.005 per step by the sign of the share error (DeepSeek's "
            "0.001 is sized for ~10^5 steps; at 0.001 every layer was still collapsed onto a few experts at step "
            "50). It did not balance this model: through step 600 the least-used expert of every layer got no "
            "token of a 16-sequence training batch. A sign step pulls a hog down no faster than it lifts each of "
            "the many starved experts.\n"
            "* steps 600–799, proportional update (0.02 × the relative share error, clipped to [−8, 1]: a hog "
            "chosen 5× its share is pulled back 4× as fast). At step 750 still 15 / 46 / 27 / 20 experts per "
            "layer got under ¼ of their share of a training batch: the logits of layers 1–3 had drifted so "
            "negative that 78–86 % of sigmoid scores were below 0.01 (2,048 validation tokens), so the bias "
            "alone decided between near-zero scores and flipped whole experts on and off. Nothing anchors the "
            "logits' level (the renormalised gates and the locality term are nearly shift-invariant there).\n"
            "* steps 800–999, + a router z-loss (0.01 × mean logit²): 50 steps later the experts under ¼ share "
            "of a training batch were [11, 1, 0, 0] (a run with 0.001: [5, 19, 15, 7]); validation loss "
            "was the same with either coefficient. This phase was planned to step 1,300 but was stopped at the "
            "step-1,000 checkpoint when the shared machine slowed it from 2.2 to 7 s per step (page faults: it "
            "then ran with jemalloc keeping freed memory).\n"
            "* steps 1000–1299 at peak LR 0.001, locality coefficient capped at 1 instead of 3 (layer 0's had "
            "reached 3 while 23 of its experts starved in a batch).\n"
            + (
                f"* then the bias alone was re-estimated on training text with the weights frozen "
                f"({tr['target']['calibration']['iters']} iterations of {tr['target']['calibration']['batches']} "
                f"batches; experts under ¼ share per layer "
                f"{tr['target']['calibration']['history'][0]['experts_below_quarter_share']} → "
                f"{tr['target']['calibration']['history'][-1]['experts_below_quarter_share']}).\n"
                if tr["target"].get("calibration")
                else ""
            )
            + "\nAlso tried, each stopped once the chosen branch was ahead: a locality cap of 0.5 in the first "
            "phase (validation loss within 0.01, lower overlap; stopped at step 600), a proportional rate of 0.05 "
            "(no better balanced than 0.02; stopped at step 700) and a z-loss of 0.001 (stopped at step 850).\n\n"
            "**The other balancing method, tried first.** A `qwen2_moe` target of the same shape (128 experts I=32, "
            "top-8, shared expert I=256) trained with Qwen3's global-batch balancing loss (counts over the "
            "optimiser batch, a guard that raised the coefficient up to 50× while an expert starved, the same kind "
            "of locality term) reached test PPL 178.00 against v1's 113.47 in 800 steps: experts died early "
            "(min share 0 for the first ~200 steps even at the capped coefficient), the guard sat at its cap for "
            "most of the run, and the balance loss and the locality term both cost cross entropy. Its routing "
            "did meet the locality goals (overlap 0.541, fetch-all LRU hit 0.871 at cache 0.25, 3.10 tokens per "
            "verification with its draft). That run is branch history (commit e997b26).\n"
        )
    return L


def global_story(x: Card) -> list[str]:
    """How a global-batch-balanced (qwen2_moe) target was trained to route."""
    tr, a, bal = x.tr, x.a, x.bal
    L: list[str] = []
    if bal == "global":
        L.append(
            "**How the v2 target is trained to route.** Router terms in `RoutingRegulariser` (`training/balance.py`); the "
            "checkpoint is a plain `qwen2_moe`:\n\n"
            "1. *Balancing over the whole optimiser batch* (Qwen3's global-batch form of the Switch loss: expert "
            f"frequencies f_i counted over all {a.get('batch_size')} sequences of the step, gradient through the "
            "mean router probabilities), plus a *selection term*: with k/E = 1/16 and near-flat logits, equal mean "
            "probabilities no longer mean equal selection, so a soft count of how often each expert clears the "
            "token's top-k threshold is pushed towards the uniform share, weighted by f_i − 1. On one process the "
            "optimiser batch is the global batch; a window of counts from earlier steps (to emulate a larger global "
            "batch) was tried and abandoned: the stale counts made the balance oscillate and left about 40 of 128 "
            "experts per layer under ¼ of the uniform share. DeepSeek-V3's auxiliary-loss-free bias balancing was "
            "not used: it selects experts on logits + a per-expert bias, and `qwen2_moe`'s router is a bias-free "
            "linear map, so the saved checkpoint would not route as trained.\n"
            "2. *Balance guard*: a layer's balance coefficient rises (up to 50×) while an expert's share of the "
            f"step is below {a.get('balance_guard')} of the uniform share and relaxes back to {a.get('aux_coef')} "
            "otherwise.\n"
            "3. *Temporal locality*: −log of the router mass token t puts on the experts token t−1 selected, with a "
            f"per-layer coefficient steered towards a consecutive-token overlap of {a.get('sticky_target')}; it "
            "only grows while the layer is balanced. This is an explicit training pressure, stated here so that "
            "nobody mistakes the locality for an emergent property; the controller's coefficients per step are in "
            "`train_log.json` (`target.routing`).\n"
        )
    rs = tr["target"].get("resumed_at_step")
    if rs and bal == "global":
        L.append(
            f"**Two phases.** Steps 0–{rs - 1} ran with the defaults, where locality yields to balance; balance "
            "took those steps to establish (at step 200, 1–16 experts per layer were still below the guard), so "
            "the locality coefficient sat at its floor. Training then resumed from the step-"
            f"{rs} checkpoint (fresh optimiser, warm-up again) with the balance coefficient starting where the guard "
            "had left it and a locality coefficient that grows regardless (the guard still raises balance when an "
            "expert starves). Both command lines are in the rebuild section; `train_log.json` keeps the whole "
            "curve.\n"
        )
    return L
