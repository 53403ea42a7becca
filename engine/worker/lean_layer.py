"""One decoder layer's sublayers as the lean forward (engine/worker/lean_forward.py) and the fused
decode step (engine/worker/fused_decode.py) read them."""

from __future__ import annotations

from typing import Any

import torch


class LeanLayer:
    """One decoder layer's sublayers, looked up once (nn.Module attribute access is a dict walk).
    The lean forward calls each through its `forward`, without the module `__call__` around it. The
    native norms and linears replaced the architecture's at load (engine/native/layers.py
    `accelerate`), before a forward looks them up. The sublayers are the architecture's own modules
    or their native counterparts, typed `Any`: their attributes (head_dim, scaling, layer_idx, ...)
    are the architecture's, which `LeanForward.supports` checked."""

    def __init__(self, layer: Any) -> None:
        att = layer.self_attn
        self.att: Any = att
        self.in_norm: Any = layer.input_layernorm
        self.post_norm: Any = layer.post_attention_layernorm
        self.mlp: Any = layer.mlp
        self.q_proj: Any = att.q_proj
        self.k_proj: Any = att.k_proj
        self.v_proj: Any = att.v_proj
        self.o_proj: Any = att.o_proj
        # Per-head q/k norms: qwen3_moe always, glm4_moe when use_qk_norm, qwen2_moe never.
        qk_norm = getattr(att, "use_qk_norm", hasattr(att, "q_norm"))
        self.q_norm: Any = att.q_norm if qk_norm else None
        self.k_norm: Any = att.k_norm if qk_norm else None
        # (q weight, k weight, q eps, k eps) for the native decode attention, once both norms are verified native ones.
        self.native_qk_norms: tuple[torch.Tensor, torch.Tensor, float, float] | None = None
