"""Locates each routed expert's bytes in the checkpoint and defines its packed buffer.

Every expert becomes one contiguous buffer of 3*I*H elements laid out as
`[gate (I*H) | up (I*H) | down (H*I)]`, so `buf[:2IH].view(2I, H)` is exactly the row
of transformers' fused `gate_up_proj` and `buf[2IH:].view(H, I)` is `down_proj`.
A load into the fast tier is therefore a single copy.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.weights.arch import ArchSpec
from engine.weights.checkpoint import TensorLocation
from engine.errors import CheckpointError


@dataclass(frozen=True)
class ExpertShape:
    hidden: int  # H
    intermediate: int  # I

    @property
    def numel(self) -> int:
        return 3 * self.hidden * self.intermediate


class ExpertLocator:
    """Maps (layer, expert) to the ordered list of tensor segments that make up its buffer."""

    def __init__(
        self,
        spec: ArchSpec,
        tensors: dict[str, TensorLocation],
        moe_layers: list[int],
        num_experts: int,
        shape: ExpertShape,
    ) -> None:
        self.shape = shape
        self.num_experts = num_experts
        self._segments: dict[tuple[int, int], list[TensorLocation]] = {}
        H, I = shape.hidden, shape.intermediate
        for layer in moe_layers:
            prefix = f"model.layers.{layer}.{spec.disk_block}.experts"
            if f"model.layers.{layer}.mlp.experts.gate_up_proj" in tensors:
                prefix = f"model.layers.{layer}.mlp.experts"  # fused checkpoints keep transformers' name
            fused_gu, fused_down = tensors.get(f"{prefix}.gate_up_proj"), tensors.get(f"{prefix}.down_proj")
            for e in range(num_experts):
                if fused_gu is not None and fused_down is not None:
                    segs = [fused_gu.slice_first_dim(e), fused_down.slice_first_dim(e)]
                    want = [(2 * I, H), (H, I)]
                else:
                    names = [f"{prefix}.{e}.{p}.weight" for p in spec.gate_up_down]
                    missing = [n for n in names if n not in tensors]
                    if missing:
                        raise CheckpointError(f"checkpoint is missing expert tensor {missing[0]} (layer {layer}, expert {e})")
                    segs = [tensors[n] for n in names]
                    want = [(I, H), (I, H), (H, I)]
                for seg, w in zip(segs, want):
                    if tuple(seg.shape) != w:
                        raise CheckpointError(f"{seg.path}: tensor {seg.name} has shape {tuple(seg.shape)}, expected {w}")
                self._segments[(layer, e)] = segs

    def segments(self, layer: int, expert: int) -> list[TensorLocation]:
        return self._segments[(layer, expert)]

    def nbytes_on_disk(self, layer: int, expert: int) -> int:
        return sum(s.nbytes for s in self._segments[(layer, expert)])
