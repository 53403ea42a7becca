"""Locates each routed expert's bytes in the checkpoint and defines its packed buffer.

Every expert becomes one contiguous buffer laid out in the order of its kernel's views
(engine/experts/formats/expert_kernels.py). For the SwiGLU families that is
`[gate (I*H) | up (I*H) | down (H*I)]`, so `buf[:2IH].view(2I, H)` is exactly the row of
transformers' fused `gate_up_proj` and `buf[2IH:].view(H, I)` is `down_proj`.
A load into the fast tier is therefore a single copy.

Two on-disk layouts occur, and both are read by offset without conversion:
- fused 3-D tensors (`experts.gate_up_proj` [E, ...], ...): expert e is row e of each;
- per-expert tensors (`experts.{e}.gate_proj.weight`, ...), what save_pretrained writes for
  most families.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from engine.errors import CheckpointError
from engine.weights.arch import ArchSpec, disk_names
from engine.weights.safetensors_index import TensorLocation


@dataclass(frozen=True)
class ExpertShape:
    hidden: int  # H
    intermediate: int  # I
    extra: int = 0  # elements beyond the three matrices (gpt-oss biases)

    @property
    def numel(self) -> int:
        return 3 * self.hidden * self.intermediate + self.extra


class _PackedSize(Protocol):
    @property
    def numel(self) -> int: ...


class SegmentLocator(Protocol):
    """What the slow tiers read experts through: ExpertLocator, or a locator standing in for it
    over raw checkpoint bytes or a quantized sidecar (engine/experts/)."""

    @property
    def num_experts(self) -> int: ...

    @property
    def shape(self) -> _PackedSize: ...  # shape.numel: elements of one packed expert

    def segments(self, layer: int, expert: int) -> list[TensorLocation]: ...

    def nbytes_on_disk(self, layer: int, expert: int) -> int: ...


class ExpertLocator:
    """Maps (layer, expert) to the ordered list of tensor segments that make up its buffer."""

    def __init__(
        self,
        spec: ArchSpec,
        tensors: dict[str, TensorLocation],
        moe_layers: list[int],
        num_experts: int,
        shape: ExpertShape,
        views: tuple[tuple[str, tuple[int, ...]], ...] | None = None,
    ) -> None:
        H, I = shape.hidden, shape.intermediate
        views = views or (("gate_up", (2 * I, H)), ("down", (H, I)))
        self.shape = ExpertShape(H, I, sum(math.prod(s) for _, s in views) - 3 * H * I)
        self.num_experts = num_experts
        self._segments: dict[tuple[int, int], list[TensorLocation]] = {}
        for layer in moe_layers:
            blocks = block_prefixes(spec, layer)
            fused = next(
                (b for b in blocks if all(f"{b}.{n}" in tensors for n in spec.fused)), None
            )
            per_expert = next(
                (
                    b
                    for b in blocks
                    if spec.gate_up_down
                    and f"{b}.experts.0.{spec.gate_up_down[0]}.weight" in tensors
                ),
                blocks[0],
            )
            for e in range(num_experts):
                if fused is not None:
                    segs = [tensors[f"{fused}.{n}"].slice_first_dim(e) for n in spec.fused]
                    want = [s for _, s in views]
                else:
                    if not spec.gate_up_down:
                        raise CheckpointError(
                            f"checkpoint is missing expert tensor {blocks[0]}.{spec.fused[0]} (layer {layer})"
                        )
                    names = [f"{per_expert}.experts.{e}.{p}.weight" for p in spec.gate_up_down]
                    missing = [n for n in names if n not in tensors]
                    if missing:
                        raise CheckpointError(
                            f"checkpoint is missing expert tensor {missing[0]} (layer {layer}, expert {e})"
                        )
                    segs = [tensors[n] for n in names]
                    want = [(I, H), (I, H), (H, I)]
                for seg, w in zip(segs, want):
                    if tuple(seg.shape) != tuple(w):
                        raise CheckpointError(
                            f"{seg.path}: tensor {seg.name} has shape {tuple(seg.shape)}, expected {tuple(w)}"
                        )
                self._segments[(layer, e)] = segs

    def segments(self, layer: int, expert: int) -> list[TensorLocation]:
        return self._segments[(layer, expert)]

    def nbytes_on_disk(self, layer: int, expert: int) -> int:
        return sum(s.nbytes for s in self._segments[(layer, expert)])

    def dtypes(self) -> set[str]:
        """The dtypes the checkpoint stores these experts in, by torch's names."""
        return {s.dtype for segs in self._segments.values() for s in segs}


def block_prefixes(spec: ArchSpec, layer: int) -> list[str]:
    """Names the sparse block of `layer` may have on disk, most likely first."""
    names: list[str] = []
    for block in dict.fromkeys((spec.disk_block, "mlp")):
        names += [n.removesuffix(".x") for n in disk_names(spec, f"model.layers.{layer}.{block}.x")]
    return list(dict.fromkeys(names))
