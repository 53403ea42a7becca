"""Which architectures take the packed attention and the lean forward: by model_type, and for the
lean forward by the structure of their decoder layers. What the load plan decides the execution path
from (engine/plan/resolve.py, on the checkpoint's tensor names: `lean_layer_names`) and what the worker's packed
batches (engine/worker/packed_batch.py) and lean forward (engine/worker/lean_forward.py) run by."""

from __future__ import annotations

from typing import Any

# Architectures whose attention is plain `cache.update` + an attention function, verified
# token-exact in packed steps (tests/test_architectures.py, tests/test_engine_core.py). The
# others run each request's window as its own forward with transformers' native attention:
# hybrid linear attention (qwen3_next, qwen3_5_moe) keeps recurrent state the packed cache
# does not carry, gpt-oss adds attention sinks that SDPA does not take, and deepseek_v3's MLA
# fails in packed mode (a head-count mismatch, not investigated yet).
PACKED_MODEL_TYPES = frozenset(
    {
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "glm4_moe",
        "minimax_m2",
        "llama4_text",
        "phimoe",
        "ernie4_5_moe",
        "granitemoe",
        "qwen3",
        "qwen2",
        "llama",
        "mistral",  # dense drafts
    }
)
# Checked against each architecture's modeling code (decoder layer and attention forward) in
# transformers 5; a new architecture joins only with a parity test in tests/test_lean_forward.py
# (MoE) or tests/test_lean_draft.py (dense).
MOE_LEAN_MODEL_TYPES = frozenset({"qwen3_moe", "glm4_moe", "qwen2_moe"})  # targets
# Drafts (engine/speculative/draft.py): qwen3's q/k norms, qwen2's q/k/v biases; mistral only
# without a sliding window (`lean_structure`).
DENSE_LEAN_MODEL_TYPES = frozenset({"qwen3", "qwen2", "llama", "mistral"})
LEAN_MODEL_TYPES = MOE_LEAN_MODEL_TYPES | DENSE_LEAN_MODEL_TYPES


def lean_config(cfg: Any) -> bool:
    """Whether the config is one the lean forward runs: its architecture, and no sliding window."""
    if cfg.model_type not in LEAN_MODEL_TYPES:
        return False
    return not (
        getattr(cfg, "sliding_window", None) is not None
        and getattr(cfg, "use_sliding_window", True)
    )


_NEED = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def lean_structure(model: Any) -> bool:
    """Whether `model`'s architecture and decoder layers are the lean forward's: "norm, attention,
    residual, norm, MLP, residual" with q/k/v/o projections, and no sliding window."""
    if not lean_config(model.config):
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        return False
    return all(
        all(hasattr(layer, n) for n in _NEED)
        and all(hasattr(layer.self_attn, p) for p in _PROJECTIONS)
        for layer in layers
    )


def lean_layer_names(names: set[str], num_layers: int) -> bool:
    """`lean_structure`'s layer check on the parameters' names (a load plan's, from the checkpoint's
    headers: engine/weights/header_survey.py): every decoder layer holds the four parts and projections."""
    return all(
        all(any(n.startswith(f"model.layers.{l}.{part}.") for n in names) for part in _NEED)
        and all(f"model.layers.{l}.self_attn.{p}.weight" in names for p in _PROJECTIONS)
        for l in range(num_layers)
    )
