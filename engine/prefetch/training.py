"""Training the router adapter (`moe-offload train-prefetcher`) and measuring its recall.

Data: a router trace with hidden states and logits (engine/offline/trace.py, recorded with the
exact policy), or text that is traced on the fly. For every token and anchor layer l (every MoE
layer but the last) one example: input x_l (layer l's router input), base = router_{l+1}(x_l)
(the FATE guess, computed once with the model's own router), teacher = layer l+1's logits.
Loss: cross entropy of the adapter's softmax against the teacher's softmax (KL up to a constant):
the router's whole distribution, so the ranking below the top-k is learned too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.prefetch.adapter import RouterAdapter, router_fingerprint
from engine.weights.moe_hook import router_ranking


@dataclass
class AdapterData:
    x: torch.Tensor  # [N, A, D] router inputs of the anchor layers
    base: torch.Tensor  # [N, A, E] next router applied to x (FATE guess)
    teacher: torch.Tensor  # [N, A, E] next layer's native router logits
    true_ids: torch.Tensor  # [N, A, k] the experts the next layer really picked
    score_bias: torch.Tensor | None = (
        None  # [A, E] next layer's selection bias (sigmoid routers), else None
    )

    @property
    def anchors(self) -> int:
        return self.x.shape[1]

    def split(self, frac: float) -> tuple[AdapterData, AdapterData]:
        """First `frac` of the tokens / the rest (contiguous: no leakage between neighbours)."""
        n = int(self.x.shape[0] * frac)
        a = AdapterData(
            self.x[:n], self.base[:n], self.teacher[:n], self.true_ids[:n], self.score_bias
        )
        b = AdapterData(
            self.x[n:], self.base[n:], self.teacher[n:], self.true_ids[n:], self.score_bias
        )
        return a, b

    def ranked(self, logits: torch.Tensor, anchor: int) -> torch.Tensor:
        """What the next layer's router ranks, for (predicted) logits [T, E] of anchor `anchor`."""
        return router_ranking(logits, None if self.score_bias is None else self.score_bias[anchor])


def moe_blocks(model: torch.nn.Module) -> dict[int, OffloadedMoeBlock]:
    return {m.layer: m for m in model.modules() if isinstance(m, OffloadedMoeBlock)}


def model_fingerprint(model: torch.nn.Module) -> str:
    blocks = moe_blocks(model)
    return router_fingerprint(
        [w for layer in sorted(blocks) for w in _router_weights(blocks[layer])]
    )


def _router_weights(block: OffloadedMoeBlock) -> list[torch.Tensor]:
    router = getattr(block, block.adapter.router)
    return list(router.parameters())


@torch.inference_mode()
def next_router_logits(block: OffloadedMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The next layer's own router on this layer's input: the FATE/ProMoE-style guess [T, E]."""
    return block.adapter.router_logits(block, x).float()


@torch.inference_mode()
def data_from_trace(
    trace: dict[str, np.ndarray], model: torch.nn.Module, moe_layers: list[int]
) -> AdapterData:
    if "hidden" not in trace or "logits" not in trace:
        raise ValueError(
            "the trace has no hidden states or logits; record it with `moe-offload trace --hidden --logits`"
        )
    blocks = moe_blocks(model)
    hidden = torch.from_numpy(trace["hidden"].astype(np.float32))  # [N, L, D]
    logits = torch.from_numpy(trace["logits"].astype(np.float32))  # [N, L, E]
    ids = torch.from_numpy(trace["ids"].astype(np.int64))  # [N, L, k]
    # The trace keeps float32; the router reads its input in the model's dtype, as while decoding.
    first = next(model.parameters())
    base = torch.stack(
        [
            torch.cat(
                [
                    next_router_logits(
                        blocks[moe_layers[a + 1]], chunk.to(first.device, first.dtype)
                    ).cpu()
                    for chunk in hidden[:, a].split(4096)
                ]
            )
            for a in range(len(moe_layers) - 1)
        ],
        dim=1,
    )
    # Sigmoid routers with a correction bias rank sigmoid(logits) + bias: read it off each next layer once.
    biases = [blocks[layer].adapter.selection_bias(blocks[layer]) for layer in moe_layers[1:]]
    score_bias = (
        None
        if any(b is None for b in biases)
        else torch.stack([b.cpu() for b in biases if b is not None])
    )
    return AdapterData(
        hidden[:, :-1].contiguous(),
        base,
        logits[:, 1:].contiguous(),
        ids[:, 1:].contiguous(),
        score_bias,
    )


def recall_at_k(pred: torch.Tensor, true_ids: torch.Tensor, k: int | None = None) -> float:
    """Mean share of the truly selected experts found among the top-k predicted ([T, E] vs [T, k_true])."""
    k = k or true_ids.shape[-1]
    top = pred.topk(k, dim=-1).indices  # [T, k]
    hit = (top.unsqueeze(-1) == true_ids.unsqueeze(-2)).any(dim=-2)  # [T, k_true]
    return float(hit.float().mean())


@torch.inference_mode()
def predict(adapter: torch.nn.Module, data: AdapterData, anchor: int) -> torch.Tensor:
    """Predicted next-layer logits [T, E] of anchor `anchor` for every token of `data`."""
    out = []
    for x, b in zip(data.x[:, anchor].split(8192), data.base[:, anchor].split(8192)):
        out.append(adapter(x, torch.full((x.shape[0],), anchor, dtype=torch.long), b))
    return torch.cat(out)


def evaluate(adapter: torch.nn.Module, data: AdapterData) -> list[float]:
    """Recall@k per anchor layer."""
    return [
        recall_at_k(data.ranked(predict(adapter, data, a), a), data.true_ids[:, a])
        for a in range(data.anchors)
    ]


def evaluate_base(data: AdapterData) -> list[float]:
    """Recall@k per anchor layer of the FATE-like guess (the next router on this layer's input)."""
    return [
        recall_at_k(data.ranked(data.base[:, a], a), data.true_ids[:, a])
        for a in range(data.anchors)
    ]


def train_adapter(
    data: AdapterData,
    rank: int = 64,
    steps: int = 1500,
    batch: int = 1024,
    lr: float = 3e-3,
    bias: bool = True,
    fate_base: bool = True,
    seed: int = 0,
    valid: AdapterData | None = None,
) -> RouterAdapter:
    torch.manual_seed(seed)
    N, A, D = data.x.shape
    adapter = RouterAdapter(D, data.teacher.shape[-1], rank, A, bias, fate_base)
    fit_predictor(
        adapter, data, steps, batch=batch, lr=lr, seed=seed, valid=valid, desc="training prefetcher"
    )
    return adapter


Predictor = torch.nn.Module  # called as module(x [T, D], anchors [T], base [T, E]) -> logits [T, E]


def fit_predictor(
    module: Predictor,
    data: AdapterData,
    steps: int = 1500,
    batch: int = 1024,
    lr: float = 3e-3,
    seed: int = 0,
    valid: AdapterData | None = None,
    desc: str = "training predictor",
) -> Predictor:
    """Fit any next-layer logit predictor with the adapter's recipe: batches of random (token,
    anchor) examples, cross entropy against the teacher's softmax, AdamW with cosine decay to
    10 % (stable last steps on a small dataset). bench/prefetch_bound.py fits richer predictors
    with it, as bounds on what the adapter could reach."""
    N, A, _ = data.x.shape
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    teacher_p = F.softmax(data.teacher, dim=-1)
    bar = tqdm(range(steps), desc=desc, unit="step")
    module.train()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        rows = torch.randint(0, N, (batch,), generator=g)
        anchors = torch.randint(0, A, (batch,), generator=g)
        out = module(data.x[rows, anchors], anchors, data.base[rows, anchors])
        loss = -(teacher_p[rows, anchors] * F.log_softmax(out, dim=-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            post = {"loss": f"{loss.item():.4f}"}
            if valid is not None and (step % 500 == 0 or step == steps - 1):
                post["valid recall@k"] = f"{np.mean(evaluate(module.eval(), valid)):.3f}"
                module.train()
            bar.set_postfix(post)
    return module.eval()
