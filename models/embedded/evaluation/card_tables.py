"""The model card's model descriptions and tables: MLP, FLOPs, the v1/v2 comparison, routing."""

from __future__ import annotations

from collections.abc import Callable

from models.embedded.evaluation.routing import num_experts


def _shared_intermediate(cfg) -> int:
    if getattr(
        cfg, "n_shared_experts", None
    ):  # glm4_moe: n_shared_experts x moe_intermediate_size, no gate
        return cfg.n_shared_experts * cfg.moe_intermediate_size
    return getattr(cfg, "shared_expert_intermediate_size", 0) or 0


def mlp_desc(cfg) -> str:
    shared = _shared_intermediate(cfg)
    gated = "sigmoid-gated" if hasattr(cfg, "shared_expert_intermediate_size") else "ungated"
    router = (
        "sigmoid router, top-k on score + balancing bias"
        if getattr(cfg, "n_routed_experts", None)
        else "softmax router"
    )
    return (
        f"{num_experts(cfg)} routed experts per layer (every layer sparse), top-{cfg.num_experts_per_tok}, "
        f"moe_intermediate_size {cfg.moe_intermediate_size}, {router}"
        + (
            f", 1 shared expert (intermediate {shared}, {gated})"
            if shared
            else ", no shared expert"
        )
        + (", norm_topk_prob" if cfg.norm_topk_prob else "")
    )


def flops_line(name: str, cfg, x: dict) -> str:
    if hasattr(cfg, "num_experts") or getattr(cfg, "n_routed_experts", None):
        shared = _shared_intermediate(cfg)
        gate = (
            f" + shared gate {cfg.hidden_size}"
            if hasattr(cfg, "shared_expert_intermediate_size")
            else ""
        )
        mlp = (
            f"MLP = top-{cfg.num_experts_per_tok} × 3 × {cfg.hidden_size} × {cfg.moe_intermediate_size} + router "
            f"{cfg.hidden_size} × {num_experts(cfg)}"
            + (f" + shared expert 3 × {cfg.hidden_size} × {shared}{gate}" if shared else "")
            + f" = {x['mlp_per_layer']:,}"
        )
    else:
        mlp = f"MLP = 3 × {cfg.hidden_size} × {cfg.intermediate_size} = {x['mlp_per_layer']:,}"
    return (
        f"* {name}: per layer attention q/k/v/o = {x['attention_per_layer']:,}, {mlp}; × {cfg.num_hidden_layers} "
        f"layers + lm_head {cfg.hidden_size} × {cfg.vocab_size} = {x['lm_head']:,} → {x['active_params']:,} active "
        f"params → **{x['flops_per_token']:,} FLOPs/token**"
    )


def _q(d: dict) -> str:
    return " / ".join(f"{d[k]:.3f}" for k in ("q05", "q25", "q50", "q75", "q95"))


# The rows of the comparison table: a title and how to read it from one pair's results.
COMPARISON_ROWS: list[tuple[str, Callable[[dict], str]]] = [
    (
        "architecture",
        lambda r: (
            f"`{r['sizes']['target']['architecture']}` / `{r['sizes']['draft']['architecture']}`"
        ),
    ),
    (
        "target model.safetensors (bf16)",
        lambda r: f"{r['sizes']['target']['safetensors_MB']:.2f} MB",
    ),
    ("target active FLOPs/token", lambda r: f"{r['sizes']['target']['flops_per_token']:,}"),
    (
        "draft active FLOPs/token (÷ target)",
        lambda r: (
            f"{r['sizes']['draft']['flops_per_token']:,} "
            f"({r['sizes']['draft_to_target_active_flops']:.4f})"
        ),
    ),
    (
        "target PPL (test, all / shakespeare / pydocs)",
        lambda r: " / ".join(
            f"{r['perplexity']['target'][d]['ppl']:.2f}" for d in ("all", "shakespeare", "pydocs")
        ),
    ),
    ("draft PPL (test, all)", lambda r: f"{r['perplexity']['draft']['all']['ppl']:.2f}"),
    (
        "tokens / verification at k=4 (all)",
        lambda r: f"{r['speculative']['mean_tokens_per_verification_incl_bonus']:.3f}",
    ),
    (
        "experts ≥ ¼ uniform share, worst layer",
        lambda r: f"{min(l['experts_ge_quarter_uniform_pct'] for l in r['routing']):.1f}%",
    ),
    (
        "usage entropy ÷ max, per layer",
        lambda r: " / ".join(f"{l['usage_entropy_normalized']:.3f}" for l in r["routing"]),
    ),
    (
        "per-token router entropy ÷ max, per layer",
        lambda r: " / ".join(
            f"{l['token_router_entropy_normalized_mean']:.3f}" for l in r["routing"]
        ),
    ),
    (
        "consecutive-token overlap of selected experts, per layer (mean)",
        lambda r: (
            " / ".join(f"{l['repeat_rate_selected_experts']:.3f}" for l in r["routing"])
            + f" (**{r['locality']['consecutive_overlap_mean']:.3f}**)"
        ),
    ),
    (
        "random-routing overlap k/E",
        lambda r: f"{r['routing'][0]['random_baseline_repeat_rate']:.4f}",
    ),
    (
        "calls served by each window's most-used 25% of experts, per layer (mean)",
        lambda r: (
            " / ".join(f"{l['window_top25pct_experts_call_share']:.3f}" for l in r["routing"])
            + f" (**{r['locality']['window_top25pct_call_share_mean']:.3f}**)"
        ),
    ),
    (
        "fetch-all hit rate, cache 0.25, LRU (shakespeare / pydocs)",
        lambda r: (
            f"**{r['cache']['all']['fetch_all_hit_rate_lru']:.3f}** ({r['cache']['shakespeare']['fetch_all_hit_rate_lru']:.3f} / "
            f"{r['cache']['pydocs']['fetch_all_hit_rate_lru']:.3f})"
        ),
    ),
    (
        "fetch-all hit rate, cache 0.25, frequency (shakespeare / pydocs)",
        lambda r: (
            f"**{r['cache']['all']['fetch_all_hit_rate_frequency']:.3f}** ({r['cache']['shakespeare']['fetch_all_hit_rate_frequency']:.3f} / "
            f"{r['cache']['pydocs']['fetch_all_hit_rate_frequency']:.3f})"
        ),
    ),
    (
        "top-1 gate (normalised) median, per layer",
        lambda r: " / ".join(
            f"{l['top1_gate_weight_normalized_quantiles']['q50']:.3f}" for l in r["routing"]
        ),
    ),
    (
        "k-th gate (normalised) median, per layer",
        lambda r: " / ".join(
            f"{l['topk_last_gate_weight_normalized_quantiles']['q50']:.3f}" for l in r["routing"]
        ),
    ),
    (
        "router mass of the top-k median, per layer",
        lambda r: " / ".join(f"{l['topk_router_mass_quantiles']['q50']:.3f}" for l in r["routing"]),
    ),
    (
        "calls with gate ≥ 0.15 (fetched by the 0.15 rule), per layer",
        lambda r: " / ".join(f"{l['calls_with_gate_ge_0_15_share']:.3f}" for l in r["routing"]),
    ),
]


def comparison_table(res: dict) -> list[str]:
    """v1 and v2 side by side: the statistics that decide offloading behaviour."""
    c = res["compare"]
    pairs = [(c["label"], c), ("v2 (this)", res)]
    L = [f"| | {pairs[0][0]} | {pairs[1][0]} |", "|---|---|---|"]
    for title, fn in COMPARISON_ROWS:
        L.append(f"| {title} | " + " | ".join(fn(r) for _, r in pairs) + " |")
    return L


def routing_table(r: list[dict]) -> list[str]:
    L = [
        "| layer | usage entropy ÷ max | token router entropy ÷ max | ≥¼ uniform share | min / max share ÷ uniform | "
        "overlap (selected) | overlap (top-1) | window top-25% call share | gate ≥ 0.15 | "
        "top-1 gate q05 / q25 / q50 / q75 / q95 | k-th gate q05 / q25 / q50 / q75 / q95 | top-k router mass q05 / q25 / q50 / q75 / q95 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for l in r:
        L.append(
            f"| {l['layer']} | {l['usage_entropy_normalized']:.3f} | {l['token_router_entropy_normalized_mean']:.3f} | "
            f"{l['experts_ge_quarter_uniform_pct']:.1f}% | "
            f"{l['min_expert_share_vs_uniform']:.2f} / {l['max_expert_share_vs_uniform']:.2f} | "
            f"{l['repeat_rate_selected_experts']:.3f} | {l['repeat_rate_top1_expert']:.3f} | "
            f"{l['window_top25pct_experts_call_share']:.3f} | {l['calls_with_gate_ge_0_15_share']:.3f} | "
            f"{_q(l['top1_gate_weight_normalized_quantiles'])} | {_q(l['topk_last_gate_weight_normalized_quantiles'])} | "
            f"{_q(l['topk_router_mass_quantiles'])} |"
        )
    return L
