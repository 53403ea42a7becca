"""What a load plan needs of a checkpoint, read off config.json and its safetensors headers alone
(tensor names, shapes, dtypes): no model is built, not even on the meta device, and no tensor made.

The in-memory model is transformers' text model; the headers name the tensors as the checkpoint stores
them. Each header name is mapped back to the name it has in memory (`memory_name`: the architecture
table's prefixes and renames, engine/weights/arch.py, undone), and kept where it is a
parameter of the text model: the input embedding, the final norm, the decoder layers below
num_hidden_layers and lm_head (a vision tower, multi-token-prediction layers and FP8 scales are not).
Of those, the routed experts are the tensors under a layer's block named `experts.` or by the table's
fused names; the layers holding them are the MoE layers. Everything else is the dense part.

Why from the headers: a plan decided without building the model cannot differ from what the files
hold, costs no meta model (seconds for a large config), and leaves the model's construction to the
loader, which builds it and checks it against this survey (engine/worker/built.py `check_built`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engine.errors import CheckpointError
from engine.native.dense_names import QUANTIZED_NAMES, DenseLinear
from engine.weights.arch import ArchSpec, unsupported
from engine.weights.forward_support import lean_config, lean_layer_names

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(\w+)\.experts\.(.+)$")  # block . experts . rest (not shared_experts)
# Persistent buffers a checkpoint stores beside the parameters: the routers' score-correction bias
# (deepseek_v3, glm4_moe, minimax_m2, dots1), a buffer in memory; ernie4_5_moe's, under
# `moe_statics`, is a parameter. FP8 scales are read with their weights, never held.
_BUFFER_SUFFIXES = (".e_score_correction_bias", ".inv_freq", "_scale_inv")


class Shaped(Protocol):
    """A tensor as a header describes it: engine/weights/safetensors_index.py `TensorLocation` (read
    without torch)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class HeaderSurvey:
    """The MoE layers and their experts' geometry, the text model's dense parameters (elements) and
    linears, the input embedding's in-memory name (None: none) and whether the lean forward's layer
    structure holds (engine/weights/forward_support.py)."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    dense_params: int
    dense_linears: tuple[DenseLinear, ...]
    embedding: str | None
    lean: bool


def memory_name(spec: ArchSpec, disk: str) -> str:
    """The in-memory name of the checkpoint tensor `disk` (engine/weights/arch.py `disk_names` undone),
    but for the sparse block's, which keeps its name on disk (`mlp`, `block_sparse_moe`, `feed_forward`):
    whether transformers calls it `mlp` in memory differs by family and the table does not say."""
    name = disk
    for mem, on_disk in spec.prefixes:
        if name.startswith(on_disk):
            name = mem + name[len(on_disk) :]
            break
    for mem, on_disk in spec.renames:
        name = name.replace(on_disk, mem)
    return name


def text_tensors(spec: ArchSpec, config: Any, tensors: Mapping[str, Shaped]) -> dict[str, Shaped]:
    """The checkpoint's tensors that are parameters of the text model, by in-memory name."""
    layers = int(config.num_hidden_layers)
    out: dict[str, Shaped] = {}
    for disk, loc in tensors.items():
        name = memory_name(spec, disk)
        if name.endswith(_BUFFER_SUFFIXES) and ".moe_statics." not in name:
            continue
        m = _LAYER.match(name)
        if (m and int(m.group(1)) < layers) or name.startswith(
            ("model.embed_tokens.", "model.norm.", "lm_head.")
        ):
            out.setdefault(name, loc)
    return out


def _expert_part(spec: ArchSpec, rest: str) -> bool:
    """Whether `rest`, a name under model.layers.{l}., is a routed expert's tensor."""
    return _EXPERT.match(rest) is not None or rest.partition(".")[2] in spec.fused


def header_survey(
    spec: ArchSpec, config: Any, tensors: Mapping[str, Shaped], config_path: str
) -> HeaderSurvey:
    """The survey of a checkpoint's headers (the module docstring); fails in one line where no layer
    holds routed experts."""
    text = text_tensors(spec, config, tensors)
    experts: dict[int, dict[str, Shaped]] = {}
    for name, loc in text.items():
        m = _LAYER.match(name)
        if m and _expert_part(spec, m.group(2)):
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = loc
    if spec.by_structure:
        experts = {l: ex for l, ex in experts.items() if _routed(text, l, ex, config)}
    if not experts:
        if spec.by_structure:
            raise unsupported(spec.model_type, config_path)
        raise CheckpointError(f"{config_path}: no sparse MoE layers in this configuration")
    layers = tuple(sorted(experts))
    E, intermediate = _geometry(spec, experts[layers[0]])
    routed = {f"model.layers.{l}.{rest}" for l in layers for rest in experts[l]}
    dense = {n: loc for n, loc in text.items() if n not in routed}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embedding = "model.embed_tokens.weight" if "model.embed_tokens.weight" in dense else None
    if tied:
        dense.pop("lm_head.weight", None)  # the embedding's table, counted once
    return HeaderSurvey(
        moe_layers=layers,
        num_experts=E,
        top_k=_top_k(config, layers[0]),
        hidden=int(config.hidden_size),
        intermediate=intermediate,
        dense_params=sum(math.prod(loc.shape) for loc in dense.values()),
        dense_linears=_dense_linears(dense, tied and embedding is not None),
        embedding=embedding,
        lean=lean_config(config) and lean_layer_names(set(text), int(config.num_hidden_layers)),
    )


def _routed(text: dict[str, Shaped], layer: int, ex: dict[str, Shaped], config: Any) -> bool:
    """A layer outside the table holds routed experts where a router weight [E, hidden] sits in the
    experts' block beside them (the structure engine/weights/moe_hook.py matches in memory)."""
    blocks = {rest.split(".experts.")[0] for rest in ex if ".experts." in rest}
    count = {int(r.split(".")[2]) for r in ex if r.split(".")[2].isdigit()}
    E = len(count) or next(iter(ex.values())).shape[0]
    want = (E, int(config.hidden_size))
    return any(
        n.startswith(f"model.layers.{layer}.{b}.")
        and n.endswith(".weight")
        and tuple(loc.shape) == want
        and ".experts." not in n
        and "shared" not in n
        for b in blocks
        for n, loc in text.items()
    )


def _geometry(spec: ArchSpec, ex: dict[str, Shaped]) -> tuple[int, int]:
    """(experts, intermediate) of one MoE layer's expert tensors, per-expert or packed."""
    per_expert = {int(r.split(".")[2]) for r in ex if r.split(".")[2].isdigit()}
    if per_expert:
        gate = next(loc for r, loc in ex.items() if r.endswith(f".{spec.gate_up_down[0]}.weight"))
        return len(per_expert), int(gate.shape[0])  # gate [I, H]
    # The packed gate-and-up tensor: [E, 2I, H], or [E, H, 2I] for the transposed kernels (gpt-oss,
    # Llama 4); MXFP4 as shipped (gpt-oss): `_blocks` [E, 2I, H/32, 16].
    by_part = {r.split(".", 1)[1]: loc for r, loc in ex.items()}
    loc = by_part.get(spec.fused[0]) or by_part[f"{spec.fused[0]}_blocks"]
    packed = loc.name.endswith("_blocks") or spec.kernel == "swiglu"
    return int(loc.shape[0]), int(loc.shape[1] if packed else loc.shape[2]) // 2


def _top_k(config: Any, layer: int) -> int:
    """Experts a token routes to (the router's top_k as transformers sets it from the config)."""
    k = getattr(config, "num_experts_per_tok", None)
    if k is None:
        k = getattr(config, "moe_topk", None)
        k = k if isinstance(k, int) or k is None else k[layer]
    if k is None:
        raise CheckpointError(
            f"{config.model_type}: cannot tell how many experts its router picks (no top_k)"
        )
    return int(k)


def _dense_linears(dense: dict[str, Shaped], tied: bool) -> tuple[DenseLinear, ...]:
    """The dense linears' weights: QUANTIZED_NAMES outside the routed experts, and lm_head (tied: the
    input embedding's table, which the embedding holds too)."""
    out = [
        DenseLinear(n, math.prod(loc.shape), int(loc.shape[0]), False)
        for n, loc in dense.items()
        if n.endswith(".weight")
        and len(loc.shape) == 2
        and (n == "lm_head.weight" or n.split(".")[-2] in QUANTIZED_NAMES)
    ]
    if tied:
        emb = dense["model.embed_tokens.weight"]
        out.append(DenseLinear("lm_head.weight", math.prod(emb.shape), int(emb.shape[0]), True))
    return tuple(out)
