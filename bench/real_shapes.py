"""Random-weight checkpoints with the released configs of real MoE models, written shard by shard.

    python -m bench.real_shapes --model qwen3-30b-a3b --out /data/qwen3-30b-a3b            # 61 GB, bf16
    python -m bench.real_shapes --model qwen3-30b-a3b --layers 4 --out .cache/real/q30-4l          # same layer shape, 4 layers
    python -m bench.real_shapes --model gpt-oss-20b --out /data/gpt-oss-20b                 # MXFP4 experts as released
    python -m bench.real_shapes --model qwen3-next-80b-a3b --layers 2 --out .cache/real/qnext-2l

Each model is its released config.json (Hugging Face, values copied below) and its real on-disk tensor
names and dtypes: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` in bf16 for the Qwen models,
`mlp.experts.{gate_up,down}_proj_{blocks,scales}` (uint8 MXFP4 blocks and e8m0 scales) with bf16 biases for
gpt-oss. Dense names and shapes come from transformers' own model, built on the meta device (nothing
allocated). Tensors are generated and written a chunk at a time, straight to the shard file: no model,
and no whole tensor beyond one chunk, is ever held in RAM.

Weights are random (normal, the config's initializer_range; norms 1). Routers get the decisive spread
models/tiny.py gives them (std 0.5), so each token picks its top-k clearly. Random weights do not
route as a trained model does, and not uniformly either: on the 4-layer Qwen3-30B-A3B checkpoint at
cache 0.25, fetch-all found 90 % of its expert calls resident (uniform routing: about 25 %; the
seed pages' real-shape sections), so a cache figure measured here is neither a trained model's
nor a bound on it.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

_SLIDING_FULL_24 = ["sliding_attention", "full_attention"] * 12
RELEASED: dict[str, dict] = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # openai/gpt-oss-20b config.json
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": _SLIDING_FULL_24,
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8"}
CHUNK_ELEMS = 8 << 20  # elements generated and written at a time (16 MiB of bf16)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    init: str  # normal | router | ones | zeros | blocks | scales

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def config_for(model: str, layers: int | None = None, **overrides: object) -> dict:
    """The released config, with `layers` decoder layers (layer_types cut to match) and any overrides."""
    cfg = {**RELEASED[model], **overrides}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            cfg["layer_types"] = list(cfg["layer_types"])[:layers]
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = layers
    return cfg


def entries(cfg: dict) -> list[Entry]:
    """Every tensor of the checkpoint, in file order: dense ones as transformers names them (meta
    model), routed experts as released checkpoints store them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(
        cfg["model_type"],
        **{
            k: v
            for k, v in cfg.items()
            if k not in ("model_type", "architectures", "quantization_config")
        },
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    out: list[Entry] = []
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            out += _expert_entries(cfg, name, tuple(t.shape))
            continue
        leaf = name.rsplit(".", 1)[-1]
        base = name[: -len(leaf) - 1]
        if base.endswith(("mlp.gate", "mlp.router")) and leaf == "weight":
            init = "router"
        elif "norm" in base.rsplit(".", 1)[-1] and leaf == "weight":
            init = "ones"
        elif leaf in ("bias", "sinks", "dt_bias"):
            init = "zeros"
        else:
            init = "normal"
        out.append(Entry(name, torch.bfloat16, tuple(t.shape), init))
    return out


def _expert_entries(cfg: dict, name: str, shape: tuple[int, ...]) -> list[Entry]:
    prefix, leaf = name.rsplit(
        ".", 1
    )  # model.layers.{l}.mlp.experts, gate_up_proj | down_proj | *_bias
    if cfg.get("quantization_config", {}).get("quant_method") == "mxfp4":
        E, H, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
        if leaf.endswith("_bias"):
            return [Entry(name, torch.bfloat16, shape, "zeros")]
        rows, cols = (2 * I, H) if leaf == "gate_up_proj" else (H, I)
        return [
            Entry(f"{prefix}.{leaf}_blocks", torch.uint8, (E, rows, cols // 32, 16), "blocks"),
            Entry(f"{prefix}.{leaf}_scales", torch.uint8, (E, rows, cols // 32), "scales"),
        ]
    if leaf != "gate_up_proj":
        return []  # down_proj is written with gate/up, per expert
    E, H, I = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    return [
        Entry(
            f"{prefix}.{e}.{p}.weight",
            torch.bfloat16,
            (I, H) if p != "down_proj" else (H, I),
            "normal",
        )
        for e in range(E)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]


def _chunks(entry: Entry, gen: torch.Generator, std: float) -> Iterator[bytes]:
    """The entry's bytes a chunk at a time, drawn on the generator's device (a GPU draws them
    hundreds of times faster than one CPU thread) and brought to the host."""
    n = math.prod(entry.shape)
    dev = gen.device
    for start in range(0, n, CHUNK_ELEMS):
        m = min(CHUNK_ELEMS, n - start)
        if entry.init == "blocks":
            t = torch.randint(0, 256, (m,), generator=gen, dtype=torch.uint8, device=dev)
        elif entry.init == "scales":  # e8m0: 2^(s - 127), weights of a few hundredths
            t = torch.randint(119, 125, (m,), generator=gen, dtype=torch.uint8, device=dev)
        elif entry.init == "ones":
            t = torch.ones(m, dtype=entry.dtype)
        elif entry.init == "zeros":
            t = torch.zeros(m, dtype=entry.dtype)
        else:
            t = (
                torch.randn(m, generator=gen, device=dev) * (0.5 if entry.init == "router" else std)
            ).to(entry.dtype)
        yield t.cpu().view(torch.uint8).numpy().tobytes()


def _shards(items: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in items:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_checkpoint(
    out: str | Path,
    model: str,
    layers: int | None = None,
    shard_bytes: int = 4 << 30,
    seed: int = 0,
    progress: bool = True,
    sparse: bool = False,
    device: str = "cpu",
    **overrides: object,
) -> Path:
    """Write `model`'s released shape (or `layers` of it, or with `overrides`) to `out`, one shard at a time.
    `sparse`: headers only, the data left as holes of the right size (no disk space; reads as zeros),
    for what reads headers alone (`moe-offload plan`). `device`: where the random numbers are drawn
    ("cuda" on a GPU machine: other numbers than the CPU's for the same seed, as fast as the disk)."""
    from models.tiny import make_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_for(model, layers, **overrides)
    items = entries(cfg)
    shards = _shards(items, shard_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = float(cfg.get("initializer_range", 0.02))
    weight_map: dict[str, str] = {}
    total = sum(e.nbytes for e in items)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"writing {model}", disable=not progress
    ) as bar:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for e in shard:
                header[e.name] = {
                    "dtype": _ST_DTYPE[e.dtype],
                    "shape": list(e.shape),
                    "data_offsets": [offset, offset + e.nbytes],
                }
                offset += e.nbytes
                weight_map[e.name] = fname
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as safetensors writes it
            with open(out / fname, "wb") as f:
                f.write(struct.pack("<Q", len(raw)) + raw)
                if sparse:
                    f.truncate(8 + len(raw) + offset)
                    bar.update(offset)
                    continue
                for e in shard:
                    for chunk in _chunks(e, gen, std):
                        f.write(chunk)
                        bar.update(len(chunk))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    cfg_out = {k: v for k, v in cfg.items()}
    cfg_out["dtype"] = cfg_out.pop("torch_dtype", "bfloat16")
    (out / "config.json").write_text(json.dumps(cfg_out, indent=2))
    tok = make_tokenizer(512)
    tok.save_pretrained(out)
    return out


_TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)  # the builder's tiny tokenizer: ids below 512

# Per-model widths cut to a few dozen, the tests' and `real_shapes_bench --tiny`'s: a pipeline check at a
# tiny depth and width, never a benchmark.
TINY_WIDTHS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(_TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "qwen3-next-80b-a3b": dict(
        _TINY,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "gpt-oss-20b": dict(_TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--model", required=True, choices=sorted(RELEASED), help="which released config to write"
    )
    ap.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    ap.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="decoder layers to write (default: the released depth); the per-layer shape is kept",
    )
    ap.add_argument(
        "--shard-gb",
        type=float,
        default=4.0,
        metavar="GB",
        help="shard size in GB (default 4, as released)",
    )
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument(
        "--sparse",
        action="store_true",
        help="headers only, data left as file holes (no disk space, zeros when read): for `moe-offload plan`, which reads headers alone",
    )
    args = ap.parse_args()
    path = write_checkpoint(
        args.out, args.model, args.layers, int(args.shard_gb * 1e9), args.seed, sparse=args.sparse
    )
    print(f"{path}: {sum(p.stat().st_size for p in path.glob('*.safetensors')) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
