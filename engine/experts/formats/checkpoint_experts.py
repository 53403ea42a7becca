"""Where the routed experts come from and how their slots are encoded: one decision per model, from the
checkpoint's headers (no torch: a load plan makes it, engine/plan/resolve.py; the loader makes it again
with the formats that compute, engine/experts/formats/expert_source.py).

1. Experts quantized in the checkpoint (gpt-oss MXFP4, FP8 block-quantized DeepSeek / MiniMax /
   Qwen-FP8): read as their raw bytes, back to back, one slot per expert (engine/experts/formats/native_quant.py).
2. Otherwise the checkpoint's float experts (ExpertLocator), either as they are or, with
   --expert-quant int8|int4, through a quantized sidecar file (engine/experts/formats/quant_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PretrainedConfig

from engine.config import EngineConfig
from engine.errors import CheckpointError, ConfigError
from engine.experts.formats.slot_layout import (
    LAYOUTS,
    KernelViews,
    Layouts,
    RawPartsLayout,
    SlotLayout,
    kernel_views,
)
from engine.weights.arch import ArchSpec
from engine.weights.expert_layout import ExpertLocator, ExpertShape, SegmentLocator, block_prefixes
from engine.weights.model_config import device_type
from engine.weights.safetensors_index import TensorLocation

if TYPE_CHECKING:
    from engine.weights.header_survey import HeaderSurvey

_MXFP4 = (
    "gate_up_proj_bias",
    "down_proj_bias",
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "down_proj_blocks",
    "down_proj_scales",
)


@dataclass(frozen=True)
class PackedShape:
    """Stands in for ExpertShape where only the packed size matters (the slow tiers use `numel`)."""

    numel: int


class RawLocator:
    """ExpertLocator's interface over checkpoint tensors read as raw bytes (their dtypes differ)."""

    def __init__(
        self,
        segments: dict[tuple[int, int], list[TensorLocation]],
        num_experts: int,
        slot_bytes: int,
    ) -> None:
        self._segments, self.num_experts, self.shape = (
            segments,
            num_experts,
            PackedShape(slot_bytes),
        )

    def segments(self, layer: int, expert: int) -> list[TensorLocation]:
        return self._segments[(layer, expert)]

    def nbytes_on_disk(self, layer: int, expert: int) -> int:
        return sum(s.nbytes for s in self._segments[(layer, expert)])


@dataclass(frozen=True)
class CheckpointExperts:
    """A checkpoint's routed experts: where their tensors are and what they compute (`kernel`: its
    geometry from the headers; the computing kernel where the loader built the model). What
    slot_format and native_slot_dtype both decide from."""

    spec: ArchSpec
    config: PretrainedConfig
    tensors: dict[str, TensorLocation]
    moe_layers: list[int]
    num_experts: int
    shape: ExpertShape
    kernel: KernelViews
    dtype: str  # the compute dtype, by torch's name ("bfloat16")
    device: str  # "cpu", "cuda:0"
    top_k: int = 0  # experts a token routes to

    @classmethod
    def of_header(
        cls,
        spec: ArchSpec,
        config: PretrainedConfig,
        tensors: dict[str, TensorLocation],
        hs: HeaderSurvey,
        dtype: str,
        device: str,
    ) -> CheckpointExperts:
        """The experts as the checkpoint's headers describe them (engine/weights/header_survey.py): what a
        load plan sizes, their kernel's geometry the architecture's; the loader's experts are
        engine/experts/formats/expert_source.py `experts_of_sites` of the model it builds, checked equal in
        geometry."""
        return cls(
            spec=spec,
            config=config,
            tensors=tensors,
            moe_layers=list(hs.moe_layers),
            num_experts=hs.num_experts,
            shape=ExpertShape(hidden=hs.hidden, intermediate=hs.intermediate),
            kernel=kernel_views(spec.kernel, hs.hidden, hs.intermediate),
            dtype=dtype,
            device=device,
            top_k=hs.top_k,
        )

    def shipped(self, formats: Layouts = LAYOUTS) -> tuple[RawPartsLayout, RawLocator] | None:
        """The format (of `formats`' classes) and locator of experts quantized in the checkpoint; None:
        float experts."""
        return _native(self, formats)

    def float_locator(self) -> ExpertLocator:
        return ExpertLocator(
            self.spec,
            self.tensors,
            self.moe_layers,
            self.num_experts,
            self.shape,
            self.kernel.views,
        )


def slot_format(
    experts: CheckpointExperts, cfg: EngineConfig, native: bool, formats: Layouts = LAYOUTS
) -> tuple[SlotLayout, SegmentLocator]:
    """The experts' slot format (of `formats`' classes: the layouts a plan sizes, or the formats that
    compute) and where the checkpoint holds their bytes, before any quantized sidecar is written: as
    shipped (MXFP4, FP8 blocks), else the float experts' format (--expert-quant's). `native`: whether the
    native kernels run (a load plan's choice, engine/plan/resolve.py)."""
    shipped = experts.shipped(formats)
    if shipped is not None:
        if cfg.expert_quant != "none":
            raise ConfigError(
                f"--expert-quant {cfg.expert_quant}: this checkpoint's experts are already quantized ({shipped[0].name})"
            )
        return shipped
    locator = experts.float_locator()
    slot_dtype = plain_slot_dtype(cfg, experts.dtype, locator, experts.device) if native else None
    fmt = formats.make(
        experts.kernel, cfg.expert_quant, cfg.quant_group(), experts.dtype, slot_dtype
    )
    return fmt, locator


def plain_slot_dtype(
    cfg: EngineConfig, dtype: str, locator: ExpertLocator, device: str
) -> str | None:
    """bf16 where unquantized experts compute in f32 on the CPU from a checkpoint that stores every one
    of them in bf16 (cfg.bf16_expert_slots): the slots keep the checkpoint's bytes, half of f32's, and
    lose nothing, since bf16 widens to f32 exactly. Only with the native kernels, which widen each
    weight as they read it; torch's path would widen a whole expert per call (`moe-offload plan`
    resolves them without this model's measurement, so on a CPU where torch measures faster the plan
    sizes bf16 slots the load then keeps in f32). None: slots in the compute dtype. Asked only where the
    native kernels run (slot_format)."""
    return _bf16_slots(cfg, dtype, locator, device)


def native_slot_dtype(experts: CheckpointExperts, cfg: EngineConfig) -> str | None:
    """The float slots' dtype if the native kernels run (plain_slot_dtype's choice then), before they are
    chosen: what their measurement (engine/native/autotune.py) must time the experts in. None: the
    compute dtype, or experts that are not float (quantized, or shipped quantized)."""
    if cfg.expert_quant != "none" or experts.shipped():
        return None
    return _bf16_slots(cfg, experts.dtype, experts.float_locator(), experts.device)


def _bf16_slots(cfg: EngineConfig, dtype: str, locator: ExpertLocator, device: str) -> str | None:
    if (
        not cfg.bf16_expert_slots
        or cfg.expert_quant != "none"
        or dtype != "float32"
        or device_type(device) != "cpu"
    ):
        return None
    return "bfloat16" if locator.dtypes() == {"bfloat16"} else None


def _native(
    experts: CheckpointExperts, formats: Layouts
) -> tuple[RawPartsLayout, RawLocator] | None:
    spec, config, tensors = experts.spec, experts.config, experts.tensors
    moe_layers, E, kernel, dtype = (
        experts.moe_layers,
        experts.num_experts,
        experts.kernel,
        experts.dtype,
    )
    H, I = experts.shape.hidden, experts.shape.intermediate
    first = block_prefixes(spec, moe_layers[0])
    if spec.kernel == "gpt_oss" and any(
        f"{b}.experts.gate_up_proj_blocks" in tensors for b in first
    ):
        bias = next(
            tensors[f"{b}.experts.gate_up_proj_bias"]
            for b in first
            if f"{b}.experts.gate_up_proj_blocks" in tensors
        )
        fmt: RawPartsLayout = formats.mxfp4(kernel, H, I, bias.dtype, dtype)
        names = lambda b, e: [(f"{b}.experts.{n}", e) for n in _MXFP4]  # noqa: E731
        probe = "experts.gate_up_proj_blocks"
    elif (
        spec.kernel == "swiglu"
        and spec.gate_up_down
        and any(f"{b}.experts.0.{spec.gate_up_down[0]}.weight_scale_inv" in tensors for b in first)
    ):
        fmt = formats.fp8_block(kernel, H, I, fp8_block_edge(config), dtype)
        names = lambda b, e: (  # noqa: E731
            [(f"{b}.experts.{e}.{p}.weight_scale_inv", None) for p in spec.gate_up_down]
            + [(f"{b}.experts.{e}.{p}.weight", None) for p in spec.gate_up_down]
        )
        probe = f"experts.0.{spec.gate_up_down[0]}.weight_scale_inv"
    else:
        return None
    segments: dict[tuple[int, int], list[TensorLocation]] = {}
    for layer in moe_layers:
        b = next((b for b in block_prefixes(spec, layer) if f"{b}.{probe}" in tensors), None)
        if b is None:
            raise CheckpointError(
                f"checkpoint is missing expert tensor {block_prefixes(spec, layer)[0]}.{probe} (layer {layer})"
            )
        for e in range(E):
            segs = []
            for (name, row), (_, _, want_dtype, want_shape) in zip(names(b, e), fmt._parts):
                loc = tensors.get(name)
                if loc is None:
                    raise CheckpointError(
                        f"checkpoint is missing expert tensor {name} (layer {layer}, expert {e})"
                    )
                loc = loc.slice_first_dim(row) if row is not None else loc
                if tuple(loc.shape) != tuple(want_shape) or loc.dtype != want_dtype:
                    raise CheckpointError(
                        f"{loc.path}: tensor {loc.name} is torch.{loc.dtype} {tuple(loc.shape)}, expected torch.{want_dtype} {tuple(want_shape)}"
                    )
                segs.append(
                    TensorLocation(
                        loc.name, loc.path, loc.offset, loc.nbytes, "uint8", (loc.nbytes,)
                    )
                )
            segments[(layer, e)] = segs
    return fmt, RawLocator(segments, E, fmt.slot_numel)


def fp8_block_edge(config: PretrainedConfig) -> int:
    """Block edge of FP8 scales: quantization_config.weight_block_size (128 in every released checkpoint)."""
    q = getattr(config, "quantization_config", None) or {}
    size = (
        q.get("weight_block_size") if isinstance(q, dict) else getattr(q, "weight_block_size", None)
    )
    return int(size[0]) if size else 128
