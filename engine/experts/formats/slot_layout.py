"""How a routed expert's weights sit in its packed buffer and how a slot encodes them, as plain data: what
a load plan sizes (engine/plan/resolve.py), with torch not imported.

A kernel's geometry (`KernelViews`) names the weights of one expert's buffer, in order, with their shapes;
the kernels that compute from them subclass it (engine/experts/formats/expert_kernels.py). A slot's layout
(`SlotLayout`) is its format's name, dtype and bytes, and where each encoded part lies; the formats that
encode and dequantize subclass it (engine/experts/formats/quant.py, native_quant.py). `Layouts` names the
classes a format is made of: these (a plan) or the computing ones (a load), so one decision makes both."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.native.decode_shapes import ITEMSIZE

View = tuple[str, tuple[int, ...]]  # (weight name, shape in the packed buffer)
Part = tuple[str, tuple[int, ...]]  # a dtype by torch's name ("uint8"), a shape
QUANT_KINDS = ("none", "int8", "int4")
_ALIGN = 16


class KernelViews:
    """The weights one expert's packed buffer holds (`views`), for experts of `hidden` H and
    `intermediate` I (engine/experts/formats/expert_kernels.py describes the three kernels)."""

    views: tuple[View, ...]
    hidden: int
    intermediate: int

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.views)


class SwiGLUViews(KernelViews):
    def __init__(self, hidden: int, intermediate: int) -> None:
        H, I = hidden, intermediate
        self.hidden, self.intermediate = H, I
        self.views = (("gate_up", (2 * I, H)), ("down", (H, I)))


class GptOssViews(KernelViews):
    def __init__(self, hidden: int, intermediate: int) -> None:
        H, I = hidden, intermediate
        self.hidden, self.intermediate = H, I
        self.views = (
            ("gate_up", (H, 2 * I)),
            ("gate_up_bias", (2 * I,)),
            ("down", (I, H)),
            ("down_bias", (H,)),
        )


class Llama4Views(KernelViews):
    def __init__(self, hidden: int, intermediate: int) -> None:
        H, I = hidden, intermediate
        self.hidden, self.intermediate = H, I
        self.views = (("gate_up", (H, 2 * I)), ("down", (I, H)))


def kernel_views(kind: str, hidden: int, intermediate: int) -> KernelViews:
    """The geometry of the kernel `kind` (the architecture table's) for experts of these widths."""
    views = {"swiglu": SwiGLUViews, "gpt_oss": GptOssViews, "llama4": Llama4Views}.get(kind)
    if views is None:
        raise ValueError(f"unknown expert kernel {kind!r}")
    return views(hidden, intermediate)


class SlotLayout:
    """A slot's format as plain data: its `name`, the kernel it stores, the slot's dtype (torch's name)
    and elements, and the dtype it computes in."""

    name: str
    kernel: KernelViews
    slot_dtype: str  # torch's name for it ("bfloat16")
    slot_numel: int
    compute_dtype: str

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * ITEMSIZE[self.slot_dtype]


class PlainLayout(SlotLayout):
    """The checkpoint's weights as floats in `slot_dtype` (default: the compute dtype); a narrower slot
    dtype is only ever one that widens exactly to the compute dtype (bf16 slots, f32 compute)."""

    def __init__(self, kernel: KernelViews, dtype: str, slot_dtype: str | None = None) -> None:
        self.name, self.kernel, self.slot_numel = "none", kernel, kernel.numel
        self.compute_dtype = dtype
        self.slot_dtype = slot_dtype or dtype


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class GroupQuantLayout(SlotLayout):
    """int8 or int4 in groups of `group` values along each 2-D weight's last dimension (0: whole rows),
    each encoded part on a 16-byte boundary (engine/experts/formats/quant.py describes the encoding)."""

    def __init__(self, kernel: KernelViews, kind: str, group: int, compute_dtype: str) -> None:
        if kind not in ("int8", "int4"):
            raise ValueError(
                f"unknown expert quantization {kind!r}; use one of {', '.join(QUANT_KINDS)}"
            )
        if group != 0 and (group < 2 or group % 2):
            raise ValueError(
                f"quantization group size must be 0 (whole rows) or an even number >= 2, got {group}"
            )
        self.name, self.kernel, self.bits, self.group = (
            kind,
            kernel,
            8 if kind == "int8" else 4,
            group,
        )
        self.compute_dtype = compute_dtype
        self.slot_dtype = "uint8"
        # Byte layout of one slot: per view, its parts as (offset, nbytes, dtype name, shape).
        self._layout: list[list[tuple[int, int, str, tuple[int, ...]]]] = []
        at = 0
        for _, shape in kernel.views:
            parts = []
            for dtype, pshape in self._parts(shape):
                nbytes = math.prod(pshape) * ITEMSIZE[dtype]
                parts.append((at, nbytes, dtype, pshape))
                at = _aligned(at + nbytes)
            self._layout.append(parts)
        self.slot_numel = at

    def group_of(self, cols: int) -> int:
        return math.gcd(cols, self.group)  # group 0: gcd(cols, 0) = cols, whole rows

    def _parts(self, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        if len(shape) != 2:
            return [("float32", shape)]  # biases: kept exact
        rows, cols = shape
        g = self.group_of(cols)
        groups = (rows, cols // g, 1)
        if self.bits == 8:
            return [("int8", (rows, cols // g, g)), ("float16", groups)]
        return [("uint8", (rows, cols // g, g // 2)), ("float16", groups), ("float16", groups)]


class RawPartsLayout(SlotLayout):
    """A slot made of the checkpoint's tensors back to back, each viewed in place with its dtype."""

    def __init__(
        self, name: str, kernel: KernelViews, parts: list[Part], compute_dtype: str
    ) -> None:
        self.name, self.kernel, self.compute_dtype, self.slot_dtype = (
            name,
            kernel,
            compute_dtype,
            "uint8",
        )
        self._parts: list[tuple[int, int, str, tuple[int, ...]]] = []
        at = 0
        for dtype, shape in parts:
            n = math.prod(shape) * ITEMSIZE[dtype]
            if at % ITEMSIZE[dtype]:
                raise ValueError(
                    f"{name}: part of dtype torch.{dtype} at unaligned byte offset {at}"
                )
            self._parts.append((at, n, dtype, shape))
            at += n
        self.slot_numel = at


class Mxfp4Layout(RawPartsLayout):
    """Slot: gate_up_bias | down_bias | gate_up blocks | gate_up scales | down blocks | down scales."""

    def __init__(
        self,
        kernel: KernelViews,
        hidden: int,
        intermediate: int,
        bias_dtype: str,
        compute_dtype: str,
    ) -> None:
        H, I = hidden, intermediate
        self.bias_dtype = bias_dtype
        parts = [
            (bias_dtype, (2 * I,)),
            (bias_dtype, (H,)),
            ("uint8", (2 * I, H // 32, 16)),
            ("uint8", (2 * I, H // 32)),
            ("uint8", (H, I // 32, 16)),
            ("uint8", (H, I // 32)),
        ]
        super().__init__("mxfp4", kernel, parts, compute_dtype)


class Fp8BlockLayout(RawPartsLayout):
    """Slot: gate, up, down scales (f32, first so they stay 4-byte aligned) | gate, up, down weights (fp8)."""

    def __init__(
        self,
        kernel: KernelViews,
        hidden: int,
        intermediate: int,
        block: int,
        compute_dtype: str,
    ) -> None:
        H, I = hidden, intermediate
        self.block = block
        mats = [(I, H), (I, H), (H, I)]
        parts: list[Part] = [
            ("float32", (math.ceil(r / block), math.ceil(c / block))) for r, c in mats
        ]
        parts += [("float8_e4m3fn", shape) for shape in mats]
        super().__init__("fp8-block", kernel, parts, compute_dtype)


@dataclass(frozen=True)
class Layouts:
    """The classes a slot's format is made of, one per kind: the layouts here (what a plan sizes) or
    the formats that encode and compute (engine/experts/formats/native_quant.py `FORMATS`)."""

    plain: type[PlainLayout]
    group_quant: type[GroupQuantLayout]
    mxfp4: type[Mxfp4Layout]
    fp8_block: type[Fp8BlockLayout]

    def make(
        self,
        kernel: KernelViews,
        kind: str,
        group: int,
        compute_dtype: str,
        plain_slot_dtype: str | None = None,
    ) -> PlainLayout | GroupQuantLayout:
        """The format of `kind` ("none", "int8", "int4"); `plain_slot_dtype`: the slots' dtype of the
        "none" format where it differs from the compute dtype (engine/experts/formats/checkpoint_experts.py
        decides)."""
        if kind == "none":
            return self.plain(kernel, compute_dtype, plain_slot_dtype)
        return self.group_quant(kernel, kind, group, compute_dtype)


LAYOUTS = Layouts(PlainLayout, GroupQuantLayout, Mxfp4Layout, Fp8BlockLayout)
