"""Router balancing for the MoE target: the per-layer Switch loss, bias balancing (glm4_moe),
the global-batch regulariser with its locality term, and the bias calibration after training."""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm


def per_layer_aux_loss(router_logits, top_k, num_experts):
    """Switch-style load-balancing loss computed PER LAYER and averaged over layers.

    transformers' load_balancing_loss_func pools the counts of all layers before multiplying, so an
    expert that is overloaded in one layer and starved in another looks balanced; on this model that
    left ~40% of the experts of every layer under 1/4 of the uniform share.  Balanced value = top_k.
    """
    tot = 0.0
    for rl in router_logits:
        probs = F.softmax(rl.float(), dim=-1)
        idx = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        f = torch.zeros(num_experts, device=rl.device).scatter_add_(
            0, idx, torch.ones_like(idx, dtype=torch.float)
        )
        f = f / probs.shape[0]
        tot = tot + num_experts * (f * probs.mean(0)).sum()
    return tot / len(router_logits)


class BiasBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al. 2024) plus a temporal-locality term,
    for routers that choose experts on score + ``e_score_correction_bias`` (glm4_moe here).

    **Balance** carries no gradient: after each optimiser step every layer's bias moves by ``rate`` towards
    balance, up for experts chosen less than the mean over the whole step's batch (all sequences: the global
    batch), down for those chosen more. The bias only changes which experts are *chosen*; the gates are the
    unbiased scores, so cross entropy never pays for balance, and since the counts are global a sequence may
    concentrate on the experts of its domain (specialisation).

    **Locality**: -log of the normalised router mass token t puts on the experts token t-1 chose, with a
    per-layer coefficient steered (multiplicatively, ``ctl_rate`` per step) towards a consecutive-token
    overlap of ``sticky_target`` and capped at ``sticky_cap``. This is an explicit training pressure; the
    model card says so. Routing is read from forward hooks on each layer's router, so the checkpoint is a
    plain glm4_moe.
    """

    def __init__(
        self,
        model,
        rate: float,
        sticky_target: float,
        sticky_coef: float,
        sticky_floor: float,
        sticky_cap: float,
        ctl_rate: float = 0.05,
        update: str = "sign",
        max_err: float = 8.0,
        z_coef: float = 0.0,
    ):
        self.routers = [layer.mlp.gate for layer in model.model.layers]
        self.L, self.k = len(self.routers), self.routers[0].top_k
        self.rate, self.ctl_rate, self.update, self.max_err, self.z_coef = (
            rate,
            ctl_rate,
            update,
            max_err,
            z_coef,
        )
        self.sticky_target, self.sticky = sticky_target, [sticky_coef] * self.L
        self.sticky_floor, self.sticky_cap = sticky_floor, sticky_cap
        self.seen: list = [None] * self.L
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))
        self.last: dict = {}

    def _hook(self, i: int):
        def record(module, inputs, output):
            if torch.is_grad_enabled():  # training forward only; evaluation leaves the record alone
                self.seen[i] = (output[0], output[2])  # raw logits (grad), chosen ids

        return record

    def state(self) -> dict:
        return {
            "sticky_coef": list(self.sticky),
            "bias_abs_max": [float(r.e_score_correction_bias.abs().max()) for r in self.routers],
            **self.last,
        }

    def __call__(self, router_logits, batch: int, seq: int) -> torch.Tensor:
        """Locality loss of this step's forward; also updates the biases and the controller (no gradient)."""
        terms, overlaps, mins, below, zs = [], [], [], [], []
        for l, (logits, ids) in enumerate(self.seen):
            E = logits.shape[-1]
            # Router z-loss on the raw logits: nothing else anchors their level (the gates and the locality
            # term are both nearly shift-invariant once sigmoid scores are small), and when they drift far
            # negative every score is ~0 and the bias alone decides, flipping whole experts on and off.
            zs.append((logits.float() ** 2).mean())
            sel = (
                torch.zeros_like(logits, dtype=torch.bool)
                .scatter_(1, ids, True)
                .view(batch, seq, E)
            )
            overlaps.append(float((sel[:, 1:] & sel[:, :-1]).sum(-1).float().mean() / self.k))
            if self.sticky_target > 0:
                s = torch.sigmoid(logits.float()).view(batch, seq, E)
                p = s / s.sum(-1, keepdim=True)
                terms.append(
                    -torch.log((p[:, 1:] * sel[:, :-1].float()).sum(-1).clamp_min(1e-6)).mean()
                )
            with torch.no_grad():
                cnt = torch.bincount(ids.reshape(-1), minlength=E).float()
                mins.append(float(cnt.min() / cnt.mean()))
                below.append(int((cnt < 0.25 * cnt.mean()).sum()))
                err = (cnt.mean() - cnt) / cnt.mean()  # > 0: chosen less than its share of the step
                # sign: DeepSeek-V3's update. proportional: a hog chosen 5x its share moves 4x as fast, so the few
                # experts that every token's saturated sigmoid scores favour are pulled back before the rest starve.
                step = torch.sign(err) if self.update == "sign" else err.clamp(-self.max_err, 1.0)
                self.routers[l].e_score_correction_bias.add_(self.rate * step)
            if self.sticky_target > 0:
                err = (self.sticky_target - overlaps[l]) / self.sticky_target
                self.sticky[l] = float(
                    min(
                        self.sticky_cap,
                        max(self.sticky_floor, self.sticky[l] * math.exp(self.ctl_rate * err)),
                    )
                )
        self.seen = [None] * self.L
        self.last = {
            "overlap": overlaps,
            "min_share_vs_uniform": mins,
            "experts_below_quarter_share": below,
            "router_z": [float(z.detach()) for z in zs],
        }
        loss = self.z_coef * sum(zs) / self.L
        if terms:
            loss = loss + sum(c * t for c, t in zip(self.sticky, terms)) / self.L
        return loss


class RoutingRegulariser:
    """Router losses of the v2 target: global-batch load balancing plus a temporal-locality term.

    **Global-batch balancing** (Qiu et al. 2025, used by Qwen3): the Switch loss E * sum_i f_i * P_i
    with the expert frequencies f_i counted over the *global* batch, i.e. all sequences of the
    optimiser step, instead of each micro-batch (Qwen3 all-reduces f_i over the data-parallel group).
    On one process the optimiser batch is the global batch.  ``window`` > 1 adds the counts of earlier
    steps to emulate a bigger one, but those counts are stale (the router has moved since): with 8
    steps the balance oscillated and left ~40 of 128 experts per layer starved, so the default is 1.
    f is a count, so it carries no gradient; the gradient flows through the mean router
    probabilities P_i.  f is normalised so that perfect balance gives 1 per layer (v1's per-layer loss
    gave top_k).  A selection term (see __call__) balances how often experts clear the top-k
    threshold, which the mean probabilities stop tracking at k/E = 1/16.

    **Temporal locality**: -log(router probability mass that token t puts on the experts token t-1
    selected), per layer.  It asks consecutive tokens to agree on experts when that costs little
    cross entropy.  Its per-layer coefficient is set by a multiplicative controller that aims the
    measured consecutive-token overlap of selected experts at ``sticky_target``: the coefficient grows
    while a layer is below the target and shrinks when above, so the term only pushes as hard as the
    data makes necessary (the logged coefficients show how hard that was).  It yields to balance: while
    a layer has a starved expert its locality coefficient only shrinks.

    **Balance guard**: the balance coefficient of a layer is raised in the same multiplicative way
    (up to 50x) while the least-used expert of that layer's window is below ``guard_share`` of the
    uniform share (the model card requires >= 1/4 for every expert), and relaxes back towards ``coef``
    otherwise; experts below ``guard_share`` also get a revive term, -log of their mean router
    probability, because the Switch gradient on a starved expert's logit is proportional to its tiny
    probability and cannot bring back an expert no token selects.

    Both controllers depend only on the routing of the seeded batches, so a seeded rerun is
    step-exact.  All three pieces only change the loss; the saved checkpoint is a plain qwen2_moe.
    """

    def __init__(
        self,
        n_layers: int,
        num_experts: int,
        top_k: int,
        mode: str,
        coef: float,
        window: int,
        sticky_target: float,
        sticky_coef: float,
        guard_share: float,
        revive_coef: float,
        start_step: int,
        select_coef: float = 0.0,
        sticky_floor: float = 1e-4,
        sticky_yields: bool = True,
        bal_init: float = 0.0,
        rate: float = 0.05,
    ):
        self.L, self.E, self.k, self.mode = n_layers, num_experts, top_k, mode
        self.coef0 = coef
        self.window = max(1, window if mode == "global" else 1)
        self.bal = [max(coef, bal_init)] * n_layers  # per-layer balance coefficients (guarded)
        self.sticky_target, self.sticky = sticky_target, [sticky_coef] * n_layers
        self.guard_share, self.rate, self.revive_coef = guard_share, rate, revive_coef
        self.select_temp = 1.0  # logit units: wide enough that a collapsed router (large logit gaps) still gets gradient
        self.select_coef = select_coef
        self.sticky_floor, self.sticky_yields = sticky_floor, sticky_yields
        # Controllers start after the warm-up: early routing is collapsed (all tokens share a hidden-state
        # direction) and would otherwise wind the coefficients to their bounds before the model has features.
        self.start_step, self.steps = start_step, 0
        self.hist: list[torch.Tensor] = []  # per step: (L, E) routing counts of earlier steps
        self.last: dict = {}

    def state(self) -> dict:
        return {"balance_coef": list(self.bal), "sticky_coef": list(self.sticky), **self.last}

    def __call__(self, router_logits, batch: int, seq: int) -> torch.Tensor:
        E, k = self.E, self.k
        bal_terms, sticky_terms, revive_terms, counts_now, overlaps, mins, n_starved = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        for l, rl in enumerate(router_logits):
            probs = F.softmax(rl.float(), dim=-1)  # (B*T, E)
            idx = torch.topk(probs, k, dim=-1).indices
            cnt = torch.bincount(idx.reshape(-1), minlength=E).float()
            counts_now.append(cnt)
            glob = cnt + sum(h[l] for h in self.hist) if self.hist else cnt
            f = glob / glob.sum() * E  # 1 per expert when balanced
            # Switch term: balances the mean router probabilities.  With k/E = 1/16 and near-flat logits that
            # no longer tracks selection: experts with a mean probability only ~30% below average were chosen
            # < 1/4 as often as average (run 3).  Selection term: a soft count of how often each expert clears
            # the token's top-k threshold (midway between the k-th and (k+1)-th logit, detached), weighted by
            # (f_i - 1) so under-selected experts are pushed up and over-selected ones down where it matters,
            # at the top-k boundary.
            srt = torch.topk(rl.float(), k + 1, dim=-1).values
            thr = (0.5 * (srt[:, k - 1] + srt[:, k])).detach().unsqueeze(-1)
            soft = torch.sigmoid((rl.float() - thr) / self.select_temp).mean(0) * (
                E / k
            )  # ~1 per expert
            sel_term = ((f - 1.0) * soft).sum() / E
            bal_terms.append((f * probs.mean(0)).sum() + self.select_coef * sel_term)
            mins.append(float(glob.min() / glob.mean()))
            n_starved.append(int((glob < self.guard_share * glob.mean()).sum()))
            low = glob < self.guard_share * glob.mean()
            if self.revive_coef > 0 and bool(low.any()):
                # The Switch loss lifts a starved expert only in proportion to its (tiny) probability, so an
                # expert that no token selects stays dead; this pulls its router row towards the tokens.
                revive_terms.append(-torch.log(probs[:, low].clamp_min(1e-9)).mean())
            sel = (
                torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, True).view(batch, seq, E)
            )
            overlaps.append(float((sel[:, 1:] & sel[:, :-1]).sum(-1).float().mean() / k))
            if self.sticky_target > 0:
                p = probs.view(batch, seq, E)
                mass = (p[:, 1:] * sel[:, :-1].float()).sum(-1).clamp_min(1e-6)
                sticky_terms.append(-torch.log(mass).mean())
        loss = sum(c * t for c, t in zip(self.bal, bal_terms)) / self.L
        if sticky_terms:
            loss = loss + sum(c * t for c, t in zip(self.sticky, sticky_terms)) / self.L
        if revive_terms:
            loss = loss + self.revive_coef * sum(revive_terms) / self.L
        # controllers (no gradient): move each layer's coefficients for the next step
        self.steps += 1
        for l in range(self.L if self.steps > self.start_step else 0):
            starved = mins[l] < self.guard_share
            if self.sticky_target > 0:
                # Balance is the hard constraint, locality the soft goal: while a layer has a starved expert its
                # locality coefficient only decays (locality concentrates mass on few experts, which is what
                # starved them), and it grows towards the target overlap only once the layer is balanced.
                err = (self.sticky_target - overlaps[l]) / self.sticky_target
                err = -abs(err) if starved and self.sticky_yields else err
                self.sticky[l] = float(
                    min(10.0, max(self.sticky_floor, self.sticky[l] * math.exp(self.rate * err)))
                )
            if self.guard_share > 0 and len(self.hist) + 1 >= self.window:
                nxt = self.bal[l] * math.exp(self.rate if starved else -self.rate / 4)
                self.bal[l] = float(min(50 * self.coef0, max(self.coef0, nxt)))
        self.hist.append(torch.stack(counts_now).detach())
        if len(self.hist) > self.window - 1:
            self.hist.pop(0)
        self.last = {
            "overlap": overlaps,
            "min_share_vs_uniform": mins,
            "experts_below_guard": n_starved,
            "balance_loss": [float(t.detach()) for t in bal_terms],
            "sticky_loss": [float(t.detach()) for t in sticky_terms],
            "layers_reviving": len(revive_terms),
        }
        return loss


def _counter(counts: torch.Tensor, E: int):
    """A forward hook that adds the router's chosen ids to `counts`. It returns None: a hook that
    returns a value replaces the module's output (the add_'s tensor once replaced the router's)."""

    def hook(mod, inp, out) -> None:
        counts.add_(torch.bincount(out[2].reshape(-1), minlength=E))

    return hook


@torch.no_grad()
def calibrate_bias(model, batcher, iters: int, batches: int, rate: float) -> list[dict]:
    """Settle a glm4_moe target's balancing bias after training, with the weights frozen.

    The bias is a statistic, not a weight (DeepSeek-V3 updates it outside the gradient step), so it can be
    re-estimated on training text like a batch-norm statistic: each iteration routes `batches` training
    batches, counts every layer's choices and moves each bias by `rate` x the relative share error (clipped
    to [-1, 1]: one step never flips a whole expert). Returns per-iteration experts under 1/4 of the
    uniform share, per layer, for the log.
    """
    routers = [layer.mlp.gate for layer in model.model.layers]
    E = routers[0].e_score_correction_bias.numel()
    counts = [torch.zeros(E) for _ in routers]
    hooks = [r.register_forward_hook(_counter(c, E)) for r, c in zip(routers, counts)]
    history = []
    try:
        for it in tqdm(range(iters + 1), desc="calibrating the balancing bias", file=sys.stdout):
            for c in counts:
                c.zero_()
            for _ in range(batches):
                model(input_ids=batcher.next()[0])
            shares = [c / c.mean() for c in counts]
            history.append(
                {
                    "iteration": it,
                    "experts_below_quarter_share": [int((sh < 0.25).sum()) for sh in shares],
                    "min_share_vs_uniform": [float(sh.min()) for sh in shares],
                }
            )
            if it == iters:
                break
            for r, sh in zip(routers, shares):
                r.e_score_correction_bias.add_(rate * (1.0 - sh).clamp(-1.0, 1.0))
    finally:
        for h in hooks:
            h.remove()
    return history
