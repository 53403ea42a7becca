"""The dense linears a load quantizes (`--dense-quant int8`) or narrows (bf16 weights read by the native
kernels), by name: what engine/native/quant_linear.py acts on in the built model and what a load plan
counts from the checkpoint's headers (engine/weights/header_survey.py). Plain data: no torch."""

from __future__ import annotations

from dataclasses import dataclass

# The nn.Linear names --dense-quant int8 quantizes: attention projections, SwiGLU MLPs (dense layers' and
# shared experts'), and the output head. Routers (`gate`, `shared_expert_gate`) and routed experts keep
# their weights: the router's kernels and the expert formats are their own (engine/experts/formats/quant.py).
QUANTIZED_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DenseLinear:
    """A dense linear's weight (`dense_linears`) as a load plan counts it from the checkpoint's headers
    (engine/weights/header_survey.py `memory_name`: in-memory, but for the sparse block's name as on disk),
    its size and rows, and whether another module holds it too (lm_head tied to the input embedding)."""

    name: str
    numel: int
    rows: int
    shared: bool
