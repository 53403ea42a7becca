"""Builds tiny random MoE checkpoints (and a tiny tokenizer) for tests and benchmarks.

Nothing is downloaded: configs are made in code, weights are random with a fixed seed,
and the tokenizer is a byte-level BPE trained on a few sentences.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")

_ARCH_KW: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_SAMPLE_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3_moe",
    layout: str = "per-expert",
    *,
    num_layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides: object,
) -> Path:
    """Write a random `arch` checkpoint to `path`.

    layout="per-expert" is what transformers' save_pretrained writes; layout="fused" stores
    the in-memory 3-D expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]), as some
    hub checkpoints do.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer() if with_tokenizer else None
    vocab = len(tok) if tok is not None else 256
    cfg = AutoConfig.for_model(
        arch,
        hidden_size=hidden,
        intermediate_size=overrides.pop("intermediate_size", 48),
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id if tok is not None else None,
        bos_token_id=None,
        pad_token_id=tok.pad_token_id if tok is not None else None,
        **{**_ARCH_KW[arch], **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init leaves routers near-uniform; scale them so routing is decisive, like a trained model.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
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
