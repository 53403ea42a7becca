"""Per-architecture adapters, only where a sparse block deviates from the generic one
(engine/weights/moe_hook.py). Each says what differs and mirrors the transformers block's
own forward, so routing and the dense parts stay exactly as trained."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.weights.moe_hook import BlockAdapter


class MiniMaxM2Adapter(BlockAdapter):
    """The router takes the block's score-correction bias (a block buffer) as an argument."""

    def route(
        self, block: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(block, self.router)(x, block.e_score_correction_bias)


class GptOssAdapter(BlockAdapter):
    """GptOssMLP returns (hidden, router scores); its decoder layer unpacks the pair."""

    def output(self, out: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor) -> tuple:
        return out, weights


class Llama4Adapter(BlockAdapter):
    """Llama 4 scales each expert's *input* by its sigmoid gate (not its output), its router
    returns (scores [T, E], logits), and the block returns (hidden, router logits).

    With one expert per token, as in every released Llama 4, scaling the input row once and
    running the expert with weight 1 is exact. With top-k > 1 each (token, expert) pair would
    need its own input row, which the executor does not do, so such configs are refused.
    """

    returns_tuple = True

    def __init__(self, native: nn.Module, model_type: str) -> None:
        super().__init__(native, model_type)
        k = getattr(getattr(native, self.router), "top_k", 1)
        if k != 1:
            raise CheckpointError(
                f"model_type={model_type!r}: Llama 4 with num_experts_per_tok={k} is not supported (only 1, as released)"
            )

    def route(
        self, block: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router = getattr(block, self.router)
        scores, logits = router(x)  # [T, E] sigmoid of the top-k logits, 0 elsewhere; [T, E]
        ids = torch.topk(logits, router.top_k, dim=1).indices  # the router's own choice
        return logits, scores.gather(1, ids), ids

    def expert_inputs(
        self, x: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x * weights, torch.ones_like(weights)

    def output(self, out: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor) -> tuple:
        return out, logits


ADAPTERS: dict[str, type[BlockAdapter]] = {
    "minimax_m2": MiniMaxM2Adapter,
    "gpt_oss": GptOssAdapter,
    "llama4_text": Llama4Adapter,
    "llama4": Llama4Adapter,
}


def adapter_for(model_type: str, native: nn.Module) -> BlockAdapter:
    return ADAPTERS.get(model_type, BlockAdapter)(native, model_type)
