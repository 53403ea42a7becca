"""Project a trace of the embedded model onto a real model's routing shape (`simulate --project-to`).

The embedded model (4 MoE layers, 128 experts, top-8, one shared expert) is not Qwen3-30B-A3B (48 layers, 128
experts, top-8) or Qwen3-Next-80B-A3B (48 layers, 512 experts, top-10, one shared expert). A
projection keeps what the trace measures (which tokens reuse which experts, how the routing
mass is spread, how it drifts with the text) and rescales the rest. What it assumes:

1. **Layers.** Projected layer l replays the trace's layer l mod L (L = 4), with its own
   independent draws below, so a 48-layer model sees 12 differently relabelled copies of each
   embedded layer. Cross-layer correlation beyond the 4 traced layers is not modelled.
2. **Experts.** With E' = m·E experts, each embedded expert e is split into m children
   e·m .. e·m + m-1 (from the 128-expert embedded model: m = 1 for Qwen3-30B, 4 for Qwen3-Next). A token routed to e goes to one
   child drawn uniformly at random per (token, layer): a parent's demand spreads evenly over its
   children, so the chance that two consecutive tokens share an expert falls by about m, as it
   would for routing that is as close to uniform in the bigger model as in the embedded one.
   A real model with skewed, sticky routing (the seeds' Qwen3 models) reuses more: projected hit
   rates are a pessimistic estimate for such models.
   With E' = E/g fewer experts (gpt-oss-20b: 32), each group of g consecutive experts merges into
   one, its routing probability the sum of theirs (its logit their logsumexp; a sigmoid router's
   merged score is its best member's), and the k' best merged experts are chosen (this needs the
   trace's logits). Merging concentrates demand, so consecutive tokens share an expert about g
   times more often: projected hit rates are optimistic for a model whose routing is as flat as
   the embedded one's over fewer experts.
3. **Top-k.** k' experts per token: the k' best as the traced router ranks them (k' = 10 needs a
   trace recorded with `--logits`): by logit, gate weights the softmax over those k' logits,
   renormalized (Qwen3's norm_topk_prob); for a sigmoid router with a balancing bias (the trace's
   meta has `score_bias`) by sigmoid + bias, gate weights the chosen sigmoid scores renormalized. Without logits and k' <= k, the first k' ids and
   their renormalized weights.
4. **Shared experts** run on the fast device for every token: they are part of the shape's dense
   time per layer (engine/offline/hardware.py SHAPES), never offloaded.
5. **Logits are not projected** (48 x 512 per token would be large and invented): a projected
   trace has none, so substituting policies stand in with `drop` (renormalize), not best-resident.

Every number from a projected trace is labelled *projected* (and *simulated*).
"""

from __future__ import annotations

import numpy as np

from engine.offline.hardware import SHAPES, ModelShape


def project_trace(trace: dict, shape: ModelShape | str, seed: int = 0) -> dict:
    """A trace of `shape`'s routing shape built from `trace` (see the module docstring)."""
    sh = SHAPES[shape] if isinstance(shape, str) else shape
    ids, weights, logits = trace["ids"], trace["weights"], trace.get("logits")
    N, L, k = ids.shape
    E = int(trace["meta"]["num_experts"])
    if sh.experts >= E and sh.experts % E == 0:
        m, g = sh.experts // E, 1  # split each expert into m children
    elif sh.experts < E and E % sh.experts == 0:
        m, g = 1, E // sh.experts  # merge each group of g experts into one
    else:
        raise ValueError(f"cannot project {E} experts onto {sh.experts}: neither divides the other")
    kk = sh.top_k
    src_layers = np.arange(sh.layers) % L
    if kk <= k and logits is None and g == 1:
        top = ids[:, src_layers, :kk].astype(np.int64)
        w = weights[:, src_layers, :kk].astype(np.float64)
    else:
        if logits is None:
            why = (
                f"merging {E} experts into {sh.experts}"
                if g > 1
                else f"projecting top-{k} onto top-{kk}"
            )
            raise ValueError(
                f"{why} needs router logits: record the trace with `moe-offload trace --logits`"
            )
        score, gate = _scores(trace, logits[:, src_layers, :].astype(np.float32), src_layers)
        if g > 1:
            score, gate = _merge(score, gate, g, softmax=trace["meta"].get("score_bias") is None)
        top = np.argsort(-score, axis=-1, kind="stable")[..., :kk].astype(np.int64)
        w = np.take_along_axis(gate, top, -1).astype(np.float64)
    w = w / w.sum(-1, keepdims=True)
    rng = np.random.default_rng(seed)
    child = rng.integers(0, m, size=top.shape) if m > 1 else 0
    out_ids = (top * m + child).astype(np.int16 if sh.experts < 32768 else np.int32)
    meta = dict(trace["meta"])
    meta.update(
        num_experts=sh.experts,
        top_k=kk,
        moe_layers=list(range(sh.layers)),
        projected=sh.name,
        projected_from={"layers": L, "experts": E, "top_k": k},
        projection_seed=seed,
    )
    meta.pop("expert_nbytes", None)  # the shape's expert size comes from the hardware profile
    return {
        "tokens": trace.get("tokens"),
        "ids": out_ids,
        "weights": w.astype(np.float32),
        "meta": meta,
    }


def _scores(trace: dict, lg: np.ndarray, src_layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per expert: the score the router ranks by and its gate before renormalising ([N, L', E] each).
    Softmax router: the logit and the softmax numerator; sigmoid router with a balancing bias
    (DeepSeek-V3 style): sigmoid + bias, and the sigmoid score."""
    bias = trace["meta"].get("score_bias")
    if bias is None:
        return lg, np.exp(lg - lg.max(-1, keepdims=True))
    s = 1.0 / (1.0 + np.exp(-lg))
    return s + np.asarray(bias, np.float32)[src_layers][None], s


def _merge(
    score: np.ndarray, gate: np.ndarray, g: int, softmax: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Groups of g consecutive experts as one: a softmax router's merged gate is the sum of the
    group's (ranked by it), a sigmoid router's is its best-scoring member's."""
    *lead, E = score.shape
    sc, gt = score.reshape(*lead, E // g, g), gate.reshape(*lead, E // g, g)
    if softmax:
        merged = gt.sum(-1)
        return merged, merged
    best = sc.argmax(-1)[..., None]
    return np.take_along_axis(sc, best, -1)[..., 0], np.take_along_axis(gt, best, -1)[..., 0]
