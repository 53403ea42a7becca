"""The training loop of one model (target or draft): the optimiser, one step's loss (cross entropy,
router balancing, distillation), the step count (given, or sized from a wall-clock budget), evals
and checkpoints on the way."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.embedded.training.balance import BiasBalancer, per_layer_aux_loss
from models.embedded.training.checkpoints import save_model, write_log


@torch.no_grad()
def eval_loss(model, batches):
    model.eval()
    tot, n = 0.0, 0
    for x, y in batches:
        logits = model(input_ids=x).logits
        tot += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum"
        ).item()
        n += y.numel()
    model.train()
    return tot / n


def lr_at(step, progress, peak, warmup, min_ratio=0.1):
    """Linear warm-up over `warmup` steps, then cosine from peak to min_ratio*peak as progress goes 0->1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, max(0.0, progress))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model, weight_decay: float, peak_lr: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def start_record(log: dict, name: str, start_step: int) -> dict:
    """The model's curves in the log: emptied for a fresh run; for a resumed one, kept up to the checkpoint."""
    rec = log.setdefault(name, {"train": [], "valid": [], "aux": []})
    if start_step:  # resumed: keep the earlier curve up to the checkpoint
        rec["resumed_at_step"] = start_step
        rec["seconds_before_resume"] = rec.get("train_seconds", 0.0)
        for k in ("train", "valid", "aux"):
            rec[k] = [
                r
                for r in rec.get(k, [])
                if r[0] < start_step or (k == "valid" and r[0] <= start_step)
            ]
    else:
        rec.update(train=[], valid=[], aux=[], routing=[])
    return rec


@dataclass
class Stepper:
    """One optimiser step: the learning rate at this point of the schedule, the loss, the update."""

    model: Any
    args: Any
    batcher: Any
    opt: torch.optim.Optimizer
    peak_lr: float
    warm0: int
    teacher: Any = None
    regulariser: Any = None

    def __call__(self, step: int, progress: float) -> tuple[float, float | None]:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step - self.warm0, progress, self.peak_lr, self.args.warmup)
        x, y = self.batcher.next()
        is_moe = hasattr(self.model.config, "num_experts")
        out = self.model(
            input_ids=x, labels=None, **({"output_router_logits": True} if is_moe else {})
        )
        logits = out.logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss, aux = self.balanced(ce, out, x)
        alpha = self.args.distill_alpha
        if self.teacher is not None and alpha > 0:
            loss = (1 - alpha) * ce + alpha * self.distill_kl(x, logits)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.opt.step()
        return ce.item(), (aux.item() if aux is not None else None)

    def balanced(self, ce, out, x) -> tuple[Any, Any]:
        """Cross entropy plus the router balancing term of this recipe, and that term (None: none)."""
        reg, cfg = self.regulariser, self.model.config
        if isinstance(reg, BiasBalancer):  # routing read by hooks; balance by bias, no loss
            aux = reg(None, x.size(0), x.size(1))
            return ce + aux, aux
        if getattr(out, "router_logits", None) is None:
            return ce, None
        if reg is not None:  # v2: global-batch balance + locality, coefficients inside
            aux = reg(out.router_logits, x.size(0), x.size(1))
            return ce + aux, aux
        # v1 recipes
        if self.args.balance == "pooled":
            aux = out.aux_loss
        else:
            aux = per_layer_aux_loss(out.router_logits, cfg.num_experts_per_tok, cfg.num_experts)
        return ce + cfg.router_aux_loss_coef * aux, aux

    def distill_kl(self, x, logits):
        """KL from the teacher's to the student's distribution at temperature T, scaled by T^2."""
        T = self.args.distill_temp
        with torch.no_grad():
            t_logits = self.teacher(input_ids=x).logits.float()
        kl = F.kl_div(
            F.log_softmax(logits / T, -1).reshape(-1, logits.size(-1)),
            F.log_softmax(t_logits / T, -1).reshape(-1, logits.size(-1)),
            log_target=True,
            reduction="batchmean",
        )
        return kl * T * T


def size_schedule(name, step_fn, args, rec, start_step, minutes) -> tuple[int, int]:
    """Time `args.bench_steps` steps and size the schedule to fill `minutes`: (steps, next step)."""
    nb = args.bench_steps
    tb = time.time()
    for s in range(start_step, start_step + nb):
        ce, aux = step_fn(s, 0.0)
        rec["train"].append([s, ce])
    dt = (time.time() - tb) / nb
    steps = max(nb + 1, int(minutes * 60 / (dt * 1.06)))  # ~6% margin for evals/saves
    print(
        f"[{name}] {dt:.3f}s/step ({args.batch_size * args.seq_len / dt:.0f} tok/s) -> ~{steps} steps "
        f"for {minutes} min",
        flush=True,
    )
    return steps, start_step + nb


def train_one(
    name,
    model,
    args,
    tok,
    batcher,
    valid_batches,
    log,
    out_dir,
    steps,
    minutes,
    peak_lr,
    teacher=None,
    start_step=0,
    regulariser=None,
):
    model.train()
    opt = make_optimizer(model, args.weight_decay, peak_lr)
    rec = start_record(log, name, start_step)
    step_fn = Stepper(model, args, batcher, opt, peak_lr, start_step, teacher, regulariser)
    t0 = time.time()
    budget = None
    if (
        not steps
    ):  # size the schedule from measured speed; the cosine then follows wall-clock progress
        budget = minutes * 60
        steps, start = size_schedule(name, step_fn, args, rec, start_step, minutes)
    else:
        start = start_step
    rec.update(steps_planned=steps, tokens_per_step=args.batch_size * args.seq_len)
    # with a step count, a resumed run trains `steps` more steps after start_step
    bar = tqdm(
        range(start, 10**9 if budget else start_step + steps),
        desc=name,
        total=steps,
        mininterval=10,
        file=sys.stdout,
    )
    s = start
    for s in bar:
        progress = (time.time() - t0) / budget if budget else (s - start_step) / steps
        last = (
            (progress >= 1.0)
            if budget
            else (s + 1 - start_step == steps or s + 1 == args.stop_after)
        )
        ce, aux = step_fn(s, progress)
        rec["train"].append([s, ce])
        if aux is not None:
            rec["aux"].append([s, aux])
        if regulariser is not None and ((s + 1) % 10 == 0 or last):
            rec.setdefault("routing", []).append([s + 1, regulariser.state()])
        if (s + 1) % args.eval_every == 0 or last:
            v = eval_loss(model, valid_batches)
            rec["valid"].append([s + 1, v])
            report_eval(name, bar, regulariser, s, steps, ce, v, aux, t0)
        if (s + 1) % args.save_every == 0 or last:
            rec["train_seconds"] = time.time() - t0 + rec.get("seconds_before_resume", 0.0)
            rec["steps_done"] = s + 1
            save_model(model, out_dir, tok)
            write_log(log, args.log_json)
        if last:
            break
    rec["train_seconds"] = time.time() - t0 + rec.get("seconds_before_resume", 0.0)
    rec["steps_done"] = s + 1
    write_log(log, args.log_json)
    return model


def report_eval(name, bar, regulariser, s, steps, ce, v, aux, t0) -> None:
    """Print an eval point: the regulariser's per-layer state, then losses and perplexity."""
    if regulariser is not None:
        st = regulariser.state()
        print(
            f"[{name}] "
            + " ".join(
                f"{k} {[round(v, 3) for v in vals]}"
                for k, vals in st.items()
                if isinstance(vals, list)
            ),
            flush=True,
        )
    bar.set_postfix(ce=f"{ce:.3f}", valid=f"{v:.3f}", aux=f"{aux:.3f}" if aux is not None else "-")
    print(
        f"\n[{name}] step {s + 1}/{steps} train_ce {ce:.4f} valid_ce {v:.4f} "
        f"ppl {math.exp(v):.1f} elapsed {(time.time() - t0) / 60:.1f} min",
        flush=True,
    )
