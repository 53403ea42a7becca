"""Routing statistics of the MoE target (per layer, from its own routers) and the fetch-all
cache hit rates of the measured routing, replayed by the project's simulator."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

GATE_QS = (0.05, 0.25, 0.5, 0.75, 0.95)


def quantiles(x: np.ndarray) -> dict:
    return {f"q{int(q * 100):02d}": float(np.quantile(x, q)) for q in GATE_QS}


class LayerCounts:
    """What routing_stats accumulates for one layer over the windows."""

    def __init__(self, E: int) -> None:
        self.counts = np.zeros(E, dtype=np.int64)
        self.rep_any, self.rep_top1 = 0.0, 0.0
        self.top1_w: list = []
        self.topk_w: list = []
        self.topk_mass: list = []
        self.tok_ent: list = []
        self.top1_raw: list = []
        self.cover: list = []  # per window: share of calls that its most-used 25% of experts serve

    def add(self, probs, topv, topi, w, B: int, T: int, k: int) -> None:
        E = len(self.counts)
        self.counts += np.bincount(topi.reshape(-1).numpy(), minlength=E)
        self.top1_w.append(w[:, 0].numpy())
        self.topk_w.append(w[:, -1].numpy())
        self.topk_mass.append(topv.sum(-1).numpy())
        self.top1_raw.append(topv[:, 0].numpy())
        self.tok_ent.append((-(probs * probs.clamp_min(1e-12).log()).sum(-1) / math.log(E)).numpy())
        sel = torch.zeros(B * T, E, dtype=torch.bool)
        sel.scatter_(1, topi, True)
        sel = sel.view(B, T, E)
        # share of experts reused from previous token
        inter = (sel[:, 1:] & sel[:, :-1]).sum(-1).float() / k
        self.rep_any += inter.sum().item()
        t1 = topi.view(B, T, k)[:, :, 0]
        self.rep_top1 += (t1[:, 1:] == t1[:, :-1]).float().sum().item()
        per_win = sel.sum(1).float()  # (B, E) calls per expert in each window
        top = torch.topk(per_win, E // 4, dim=-1).values.sum(-1)
        self.cover.append((top / (T * k)).numpy())

    def stats(self, l: int, k: int, n_pairs: int) -> dict:
        counts, E = self.counts, len(self.counts)
        share = counts / counts.sum()
        ent = float(-(share[share > 0] * np.log(share[share > 0])).sum())
        alive = share >= 0.25 / E
        return {
            "layer": l,
            "routed_assignments": int(counts.sum()),
            "usage_entropy_nats": ent,
            "usage_entropy_normalized": ent / math.log(E),
            "token_router_entropy_normalized_mean": float(np.concatenate(self.tok_ent).mean()),
            "experts_never_routed_share": float((counts == 0).mean()),
            "experts_ge_quarter_uniform_pct": float(100 * alive.mean()),
            "min_expert_share_vs_uniform": float(share.min() * E),
            "max_expert_share_vs_uniform": float(share.max() * E),
            "repeat_rate_selected_experts": float(self.rep_any / n_pairs),
            "repeat_rate_top1_expert": float(self.rep_top1 / n_pairs),
            "random_baseline_repeat_rate": k / E,
            "window_top25pct_experts_call_share": float(np.concatenate(self.cover).mean()),
            "top1_gate_weight_normalized_quantiles": quantiles(np.concatenate(self.top1_w)),
            "topk_last_gate_weight_normalized_quantiles": quantiles(np.concatenate(self.topk_w)),
            "topk_router_mass_quantiles": quantiles(np.concatenate(self.topk_mass)),
            "top1_router_prob_quantiles": quantiles(np.concatenate(self.top1_raw)),
        }


@torch.no_grad()
def routing_stats(model, wins, batch, T):
    """Per-layer routing statistics of the target over the given windows.

    Returns (layers, trace): `layers` is a list of per-layer dicts for eval.json; `trace` holds the
    top-k ids and the gate weights the model applies, [N, L, k] in text order, the format of
    engine.offline.trace, so the cache simulation replays exactly what was measured here.
    """
    cfg = model.config
    E, k, L = num_experts(cfg), cfg.num_experts_per_tok, cfg.num_hidden_layers
    routers = RouterTap(model)
    per_layer = [LayerCounts(E) for _ in range(L)]
    n_pairs = 0
    ids_all, w_all = [], []
    for i in range(0, len(wins), batch):
        x = torch.stack(wins[i : i + batch])[:, :-1]
        B = x.size(0)
        model(input_ids=x)
        ids_l, w_l = [], []
        for l, (probs, topv, topi, w) in enumerate(routers.take()):
            ids_l.append(topi.view(B, T, k))
            w_l.append(w.view(B, T, k))
            per_layer[l].add(probs, topv, topi, w, B, T, k)
        n_pairs += B * (T - 1)
        ids_all.append(torch.stack(ids_l, dim=2).reshape(B * T, L, k))
        w_all.append(torch.stack(w_l, dim=2).reshape(B * T, L, k))
    layers = [per_layer[l].stats(l, k, n_pairs) for l in range(L)]
    routers.close()
    ids_t = torch.cat(ids_all).numpy()
    w_t = torch.cat(w_all).numpy()
    # share of calls whose gate passes the 0.15 rule (fetched on a miss by Quality-First)
    for l in range(L):
        layers[l]["calls_with_gate_ge_0_15_share"] = float((w_t[:, l, :] >= 0.15).mean())
    return layers, {
        "ids": ids_t.astype(np.int16),
        "weights": w_t.astype(np.float32),
        "meta": {"num_experts": E, "top_k": k},
    }


def num_experts(cfg) -> int:
    return getattr(cfg, "n_routed_experts", None) or cfg.num_experts


class RouterTap:
    """Reads each MoE layer's routing from its router module: what the model itself chose and applied.

    Every transformers 5 router here returns (logits, applied top-k weights, top-k ids). `take()` gives
    per layer: the router's distribution over experts (softmax of the logits; for sigmoid routers
    with a balancing bias (glm4_moe) the sigmoid scores normalised to sum 1), that distribution at the
    chosen experts, the chosen ids and the applied weights, each ordered by applied weight, largest first.
    """

    def __init__(self, model) -> None:
        from engine.weights.moe_hook import router_name

        self.records: list = []
        self.sigmoid, self.handles = [], []
        for layer in model.model.layers:
            router = getattr(layer.mlp, router_name(layer.mlp))
            self.sigmoid.append(hasattr(router, "e_score_correction_bias"))
            self.handles.append(
                router.register_forward_hook(lambda mod, inp, out: self.records.append(out))
            )

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = []
        for sig, (logits, w, ids) in zip(self.sigmoid, self.records):
            if sig:
                s = torch.sigmoid(logits.float())
                probs = s / s.sum(-1, keepdim=True)
            else:
                probs = F.softmax(logits.float(), dim=-1)
            w, order = w.float().sort(-1, descending=True)
            ids = ids.gather(1, order)
            out.append((probs, probs.gather(1, ids), ids, w))
        self.records = []
        return out


def cache_hit_rates(trace: dict, fraction: float, tokens: int) -> dict:
    """Fetch-all hit rate at a fast tier of `fraction` of all experts, replayed by the project's
    router-trace simulator (engine.offline.simulator: one slot pool over all layers, the current
    layer's experts pinned, the engine's round-robin warm start) with the engine's own eviction
    objects.  Only residency matters for the hit rate; the hardware profile is a placeholder."""
    from engine.offline.hardware import costs_for
    from engine.offline.simulator import SimSettings, Simulator
    from policies.registry import make_policies

    costs = costs_for("this-machine-disk", "embedded")  # only residency matters for the hit rate
    sub = {
        "ids": trace["ids"][:tokens],
        "weights": trace["weights"][:tokens],
        "meta": trace["meta"],
    }
    out = {"cache_fraction": fraction, "tokens": int(len(sub["ids"]))}
    for ev in ("lru", "frequency"):
        r = Simulator(
            sub,
            make_policies("fetch-all", eviction=ev),
            costs,
            SimSettings(cache_fraction=fraction),
        ).run()
        out[f"fetch_all_hit_rate_{ev}"] = r.calls_hit / r.calls
    return out
