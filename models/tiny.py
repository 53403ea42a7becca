"""Builds tiny random MoE checkpoints (and a tiny tokenizer) for tests and benchmarks.

Nothing is downloaded: configs are made in code, weights are random with a fixed seed,
and the tokenizer is a byte-level BPE trained on a few sentences.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast
from transformers.core_model_loading import revert_weight_conversion

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
# Families opened by the generic MoE hook (engine/weights/moe_hook.py); tests/test_architectures.py.
NEW_ARCHS = (
    "qwen3_next",
    "qwen3_5_moe_text",
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe",
    "minimax_m2",
    "llama4_text",
    "granitemoe",
    "phimoe",
    "ernie4_5_moe",
)
STRUCTURAL_ARCHS = (
    "hunyuan_v1_moe",
    "dots1",
)  # families outside the architecture table, run by structure
_HYBRID = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    head_dim=16,
)
_MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)

_ARCH_KW: dict[str, dict] = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=16,
    ),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    # Expert intermediate 24 (not H/2 = 32) so a transposed [H, 2I] weight can never pass for [2I, H].
    "qwen3_next": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        **_HYBRID,
    ),
    "qwen3_5_moe_text": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        **_HYBRID,
    ),
    # The first layer dense (first_k_dense_replace), two expert groups of which one is kept (group-limited routing).
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=24,
        n_shared_experts=1,
        num_hidden_layers=3,
        **_MLA,
    ),
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=24,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    ),
    "glm4_moe": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=24,
        n_shared_experts=1,
        num_hidden_layers=3,
        head_dim=16,
    ),
    "minimax_m2": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, head_dim=16
    ),
    "llama4_text": dict(
        num_local_experts=8,
        num_experts_per_tok=1,
        intermediate_size=24,
        intermediate_size_mlp=40,
        head_dim=16,
    ),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
    # Not in engine/weights/arch.py's table: run by structure (a router nested as gate.wg, an ungated shared_mlp).
    "hunyuan_v1_moe": dict(
        num_experts=8, num_local_experts=8, moe_topk=2, moe_intermediate_size=24, head_dim=16
    ),
    "dots1": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        first_k_dense_replace=1,
        n_shared_experts=1,
        num_hidden_layers=3,
        head_dim=16,
    ),
    "ernie4_5_moe": dict(
        moe_num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        head_dim=16,
    ),
}
# Multimodal wrappers whose released checkpoints keep the text model under another prefix.
_HUB_WRAPPERS = {
    "qwen3_5_moe_text": ("qwen3_5_moe", (("model.", "model.language_model."),)),
    "llama4_text": (
        "llama4",
        (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    ),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question.",
    "Mixture-of-Experts models route each token to a few experts.",
    "def main():\n    print('hello world')\n",
    "Hello, how are you today? I am fine, thank you.",
] * 20


def make_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_SAMPLE_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(
    arch: str,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    vocab: int = 256,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    **overrides: object,
) -> PretrainedConfig:
    """The tiny `arch` model's config (`overrides` replace the architecture's settings)."""
    kw = {**_ARCH_KW[arch], **overrides}
    return AutoConfig.for_model(
        arch,
        hidden_size=hidden,
        intermediate_size=kw.pop("intermediate_size", 48),
        num_hidden_layers=kw.pop("num_hidden_layers", num_layers),
        num_attention_heads=kw.pop("num_attention_heads", 4),
        num_key_value_heads=kw.pop("num_key_value_heads", 2),
        vocab_size=vocab,
        max_position_embeddings=kw.pop("max_position_embeddings", 512),
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=pad_token_id,
        **kw,
    )


def write_tiny_headers(
    path: str | Path,
    arch: str = "qwen3_moe",
    dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> Path:
    """config.json and one safetensors file of the tiny `arch` model's tensors (names, shapes, `dtype`,
    as save_pretrained names them: the "per-expert" layout) with no data: holes of the right size. The
    model is built on the meta device, so no weight is made; for what reads headers only (a load plan)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **overrides)
    if dtype != torch.float32:
        cfg.dtype = dtype  # config.json says what the checkpoint stores
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # The names and shapes save_pretrained writes (per-expert tensors where it splits them), on meta tensors.
    state = revert_weight_conversion(model, model.state_dict())
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    cfg.save_pretrained(path)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": {torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes it
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3_moe",
    layout: str = "per-expert",
    *,
    num_layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    with_tokenizer: bool = True,
    tokenizer_vocab: int = 256,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> Path:
    """Write a random `arch` checkpoint to `path`.

    tokenizer_vocab > 256 gives the byte-level BPE merges (256 is the byte alphabet alone, which
    llama.cpp's loader refuses). layout="per-expert" is what transformers' save_pretrained writes; layout="fused" stores
    the in-memory 3-D expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]), as some
    hub checkpoints do. `dtype`: the stored dtype (routers are randomized in float32 first).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(tokenizer_vocab) if with_tokenizer else None
    cfg = tiny_config(
        arch,
        num_layers=num_layers,
        hidden=hidden,
        vocab=len(tok) if tok is not None else 256,
        eos_token_id=tok.eos_token_id if tok is not None else None,
        pad_token_id=tok.pad_token_id if tok is not None else None,
        **overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init leaves routers near-uniform; scale them so routing is decisive, like a trained model.
    # Routing-bias buffers (DeepSeek-style) start at zero; make them matter so a lost one shows.
    from engine.weights.moe_hook import find_moe_sites, router_name

    with torch.no_grad():
        for site in find_moe_sites(model):
            router = getattr(site.block, router_name(site.block))
            (
                router.weight
                if isinstance(getattr(router, "weight", None), torch.Tensor)
                else next(router.children()).weight
            ).normal_(0.0, 0.5)
            for name, buf in site.block.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.1)
    if (
        dtype != torch.float32
    ):  # a checkpoint stored in bf16/fp16, as released ones are (config.json says so)
        model = model.to(dtype)
        cfg.dtype = dtype
    if layout == "per-expert":
        kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kw)
    elif layout == "fused":
        cfg.save_pretrained(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(cfg, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        if model.generation_config is not None:
            model.generation_config.save_pretrained(path)
    elif layout == "hub":
        _save_hub_layout(model, cfg, path)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if tok is not None:
        tok.save_pretrained(path)
    return path


def load_reference(path: str | Path) -> torch.nn.Module:
    """The transformers reference model, fully in memory, fp32."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def config_dict(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _save_hub_layout(model: torch.nn.Module, cfg: object, path: Path) -> None:
    """The layout of released multimodal checkpoints (Qwen3.5/3.6 MoE, Llama 4): the wrapper's
    config.json with our config as its text_config, the text weights under the wrapper's prefix,
    and fused expert tensors as in memory."""
    wrapper, prefixes = _HUB_WRAPPERS[cfg.model_type]
    wcfg = AutoConfig.for_model(wrapper, text_config=cfg.to_dict())
    wcfg.save_pretrained(path)
    state = {}
    for k, v in model.state_dict().items():
        for mem, disk in prefixes:
            if k.startswith(mem):
                k = disk + k[len(mem) :]
                break
        state[k] = v.contiguous()
    if getattr(cfg, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
