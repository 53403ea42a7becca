"""What a model needs, in bytes, from its config and safetensors headers alone (nothing is read
but the headers, so this takes seconds for a 160 GB checkpoint): the dense part in the compute
dtype (less what narrower dense weights save: `dense_saved`), one fast-tier slot per routed expert, KV
cache per token, activation scratch. Plain numbers: the compute dtype is torch's name for it
("bfloat16"), sized by engine/native/decode_shapes.py `ITEMSIZE`, so a plan is sized with torch not
imported."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PretrainedConfig

from engine.native.decode_shapes import ITEMSIZE
from engine.native.dense_names import DenseLinear, dense_bytes_saved, narrows_dense
from engine.weights.model_config import device_type

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.weights.safetensors_index import TensorLocation

MiB = 1 << 20


@dataclass(frozen=True)
class Footprint:
    dtype: str  # compute dtype, torch's name for it ("bfloat16")
    # Parameters outside the routed experts, held in memory: in the compute dtype, less what --dense-quant
    # and bf16 dense weights save (engine/native/dense_names.py dense_bytes_saved).
    dense_bytes: int
    slot_bytes: int  # one routed expert as the tiers store it
    expert_disk_bytes: int  # one routed expert as the checkpoint stores it (what a disk read moves)
    moe_layers: int
    experts_per_layer: int
    top_k: int
    kv_bytes_per_token: int  # full-attention layers, K and V, compute dtype
    sliding_kv_bytes_per_token: int  # sliding-window layers (bounded by the window)
    sliding_window: int
    context: int  # max_position_embeddings
    hidden: int
    intermediate: int  # largest of the dense MLP and top-k routed intermediates
    vocab: int
    checkpoint_bytes: int  # every tensor on disk
    # Dense parameters left in the checkpoint, outside dense_bytes: the input embedding's table less
    # its row cache (engine/weights/disk_embedding.py), whose rows each step reads.
    dense_on_disk_bytes: int = 0
    # Bytes the load's int8 or bf16 dense linears take off dense_bytes (already subtracted there).
    dense_saved_bytes: int = 0

    @property
    def total_experts(self) -> int:
        return self.moe_layers * self.experts_per_layer

    @property
    def experts_bytes(self) -> int:
        return self.total_experts * self.slot_bytes

    def kv_bytes(self, tokens: int, sequences: int) -> int:
        """KV cache for `sequences` of `tokens` each: full layers grow with the tokens, sliding ones stop at the window."""
        per_seq = (
            tokens * self.kv_bytes_per_token
            + min(tokens, self.sliding_window or tokens) * self.sliding_kv_bytes_per_token
        )
        return sequences * per_seq

    def scratch_bytes(self, chunk_tokens: int = 1024) -> int:
        """Activation scratch for one prefill chunk: the residual stream, attention and MLP
        intermediates (16 x hidden and 4 x the widest intermediate per token, float32), eight rows of
        logits, and 64 MiB for the allocator and kernels' workspaces. An estimate, stated as one."""
        per_token = (16 * self.hidden + 4 * self.intermediate) * 4
        return chunk_tokens * per_token + 8 * self.vocab * 4 + 64 * MiB


def kv_per_token(config: PretrainedConfig, dtype: str) -> tuple[int, int, int]:
    """(full-attention bytes per token, sliding-window bytes per token, window) for KV in `dtype`.
    Linear-attention layers (gated delta-net) keep a fixed state per sequence, counted in scratch."""
    L = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * L)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if getattr(config, "kv_lora_rank", None):  # MLA, as transformers caches it: per-head K and V
        k = heads * (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim))
        v = heads * int(config.v_head_dim)
    else:
        k = v = kv_heads * head_dim
    per_layer = (k + v) * ITEMSIZE[dtype]
    full = sum(t in ("full_attention", "attention") for t in types)
    sliding = sum(t in ("sliding_attention", "chunked_attention") for t in types)
    window = int(getattr(config, "sliding_window", None) or 0) if sliding else 0
    return full * per_layer, sliding * per_layer, window


def footprint(
    dense_params: int,
    moe_layers: int,
    config: PretrainedConfig,
    dtype: str,
    slot_bytes: int,
    expert_disk_bytes: int,
    experts_per_layer: int,
    top_k: int,
    moe_intermediate: int,
    tensors: dict[str, TensorLocation],
    dense_on_disk_bytes: int = 0,
    dense_saved_bytes: int = 0,
) -> Footprint:
    """The footprint of a model of `dense_params` parameters outside its routed experts (the text
    model's, from the checkpoint's headers: engine/weights/header_survey.py) and `moe_layers` MoE layers,
    whose experts the tiers hold; `dense_on_disk_bytes` of its dense parameters stay in the checkpoint,
    and the load's narrower dense weights take `dense_saved_bytes` off."""
    dense = dense_params * ITEMSIZE[dtype] - dense_on_disk_bytes - dense_saved_bytes
    full, sliding, window = kv_per_token(config, dtype)
    dense_i = int(getattr(config, "intermediate_size", 0) or 0)
    return Footprint(
        dtype=dtype,
        dense_bytes=dense,
        dense_saved_bytes=dense_saved_bytes,
        slot_bytes=slot_bytes,
        expert_disk_bytes=expert_disk_bytes,
        moe_layers=moe_layers,
        experts_per_layer=experts_per_layer,
        top_k=top_k,
        kv_bytes_per_token=full,
        sliding_kv_bytes_per_token=sliding,
        sliding_window=window,
        context=int(getattr(config, "max_position_embeddings", 4096) or 4096),
        hidden=int(config.hidden_size),
        intermediate=max(dense_i, top_k * moe_intermediate),
        vocab=int(config.vocab_size),
        checkpoint_bytes=sum(t.nbytes for t in tensors.values()),
        dense_on_disk_bytes=dense_on_disk_bytes,
    )


def checkpoint_dir_bytes(model_dir: str | Path) -> int:
    """Bytes of the *.safetensors files in a model directory."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def dense_saved(
    linears: Iterable[DenseLinear],
    tensors: dict[str, TensorLocation],
    cfg: EngineConfig,
    device: str,
    dtype: str,
    native: bool,
) -> int:
    """Dense bytes the load will not hold in the compute `dtype` (torch's name for it): --dense-quant int8 codes, and an f32
    model's bf16 dense weights where the native kernels read them (`native`: the plan's kernel answer; the
    loader's rule for narrow_dense, dense_names.narrows_dense);
    `linears`: the dense linears as the checkpoint's headers name them (engine/weights/header_survey.py)."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    narrow = narrows_dense(cfg.bf16_dense, device_type(device), native)
    return dense_bytes_saved(linears, dtype, dtypes, cfg.dense_quant, narrow)
