"""The embedded pair's model configurations (target MoE, dense draft) and their active parameters."""

from __future__ import annotations

from models.embedded.training.paths import BOS_ID, EOS_ID, PAD_ID


def target_config(args):
    """v2 (default): qwen2_moe with a shared expert and fine-grained routed experts, shaped like
    Qwen1.5/Qwen2-MoE and Qwen3-Next (many small routed experts + an always-on shared expert) but tiny.
    v1: the original 64-expert qwen3_moe without a shared expert (kept for reproducing the old card)."""
    common = dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_dropout=0.0,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        # False: the trainer computes its own balance loss from the router logits it records, so the
        # model's own (layer-pooled) aux loss is never needed at inference.
        output_router_logits=False,
        router_aux_loss_coef=args.aux_coef,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
    )
    if args.arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        # DeepSeek-V3-style routing: sigmoid scores, top-k chosen on score + a per-expert correction bias (the
        # auxiliary-loss-free balancing buffer), gates = the chosen scores renormalised; one shared expert of
        # n_shared_experts x moe_intermediate_size; every layer sparse (first_k_dense_replace=0); one group.
        g = {
            k: v
            for k, v in common.items()
            if k
            not in (
                "num_experts",
                "decoder_sparse_step",
                "mlp_only_layers",
                "output_router_logits",
                "router_aux_loss_coef",
            )
        }
        g["rope_parameters"] = {**common["rope_parameters"], "partial_rotary_factor": 1.0}
        return Glm4MoeConfig(
            n_routed_experts=args.num_experts,
            n_shared_experts=args.shared_intermediate // args.moe_intermediate,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            attention_bias=True,
            use_qk_norm=False,
            num_mtp_layers=0,
            **g,
        )
    if args.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(attention_bias=False, **common)
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        shared_expert_intermediate_size=args.shared_intermediate,
        qkv_bias=True,
        use_sliding_window=False,
        **common,
    )


def draft_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=8192,
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
    )


def active_params(cfg) -> dict:
    """Parameters touched by matmuls for one token (lm_head counted once, embedding lookup free)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", h // cfg.num_attention_heads)
    shared = 0
    attn = h * cfg.num_attention_heads * hd * 2 + h * cfg.num_key_value_heads * hd * 2  # q,o + k,v
    if getattr(cfg, "n_routed_experts", None):  # glm4_moe: shared expert without a gate
        mlp = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.n_routed_experts
        shared = cfg.n_shared_experts * cfg.moe_intermediate_size
        mlp += 3 * h * shared
    elif hasattr(cfg, "num_experts"):
        mlp = (
            cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.num_experts
        )  # experts + router
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        if shared:  # qwen2_moe: always-on shared expert + its 1-output sigmoid gate
            mlp += 3 * h * shared + h
    else:
        mlp = 3 * h * cfg.intermediate_size
    lm_head = h * cfg.vocab_size
    per_layer = attn + mlp
    total = L * per_layer + lm_head
    return {
        "attention_per_layer": attn,
        "mlp_per_layer": mlp,
        "lm_head": lm_head,
        "shared_expert_per_layer": (
            3 * h * shared + (0 if getattr(cfg, "n_routed_experts", None) else h)
        )
        if shared
        else 0,
        "active_params": total,
        "flops_per_token": 2 * total,
    }
