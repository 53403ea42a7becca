"""Finds the sparse MoE blocks of any transformers 5 model by their structure.

A sparse block is a module with an `experts` child holding fused 3-D `gate_up_proj` and
`down_proj` parameters, next to a router: the child whose weight is [num_experts, hidden].
Everything else in the block (shared experts, their gate, routing-bias buffers) is dense and
stays on the compute device, under the same names, so the checkpoint fills it as before.

How a block *uses* its parts is captured by a BlockAdapter: the generic one calls the router
as `router(x) -> (logits, top-k weights, top-k ids)` and adds `shared_expert(x)` (gated by
`sigmoid(shared_expert_gate(x))` when there is one) or `shared_experts(x)`. Architectures that
deviate get a small subclass in engine/weights/arch_adapters.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import CheckpointError
from engine.native.loaded import usable
from engine.native.router import ROUTER_CLASSES, NativeSigmoidRouter, NativeTopKRouter

# Dense parts of a sparse block that the generic adapter knows how to combine.
_SHARED = ("shared_expert", "shared_expert_gate", "shared_experts", "shared_mlp")


@dataclass
class MoeSite:
    """One sparse block: `getattr(parent, attr) is block`, in decoder layer `layer`."""

    layer: int
    parent: nn.Module
    attr: str
    block: nn.Module


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    for owner in (base, getattr(base, "language_model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise CheckpointError(f"{type(model).__name__}: cannot find the decoder layers (model.layers)")


def _fused_experts(module: nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gu.dim() == 3
        and down.dim() == 3
    )


def router_name(block: nn.Module) -> str | None:
    """The child that routes: its weight is [num_experts, hidden]."""
    experts = getattr(block, "experts", None)
    if experts is None or not _fused_experts(experts):
        return None
    E = experts.gate_up_proj.shape[0]
    for name, child in block.named_children():
        if name != "experts" and _router_weight(child, E) is not None:
            return name
    return None


def _router_weight(child: nn.Module, E: int) -> torch.Tensor | None:
    """The child's [E, hidden] weight: its own, or that of its one linear layer (HunYuan's gate.wg)."""
    w = getattr(child, "weight", None)
    if not isinstance(w, torch.Tensor):
        inner = [
            m for m in child.children() if isinstance(getattr(m, "weight", None), torch.Tensor)
        ]
        w = (
            inner[0].weight
            if len(inner) == 1 and not any(True for _ in child.parameters(recurse=False))
            else None
        )
    return w if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == E else None


def is_sparse_moe_block(module: nn.Module) -> bool:
    return router_name(module) is not None


def find_moe_sites(model: nn.Module) -> list[MoeSite]:
    sites = []
    for i, layer in enumerate(decoder_layers(model)):
        for attr, child in layer.named_children():
            if is_sparse_moe_block(child):
                sites.append(MoeSite(i, layer, attr, child))
    return sites


def router_ranking(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The scores a router ranks to pick its top-k: the logits themselves, or for a DeepSeek-V3-style
    router with a balancing bias [E], sigmoid(logits) + bias."""
    return logits if bias is None else torch.sigmoid(logits.float()) + bias


class BlockAdapter:
    """How a sparse block routes, adds its dense parts and returns. The generic case."""

    returns_tuple = False  # gpt-oss and Llama 4 blocks return (hidden, router output)

    def __init__(self, native: nn.Module, model_type: str) -> None:
        router = router_name(native)
        assert router is not None, "not a sparse MoE block"
        self.router: str = router
        self._logits_are_linear: bool | None = None  # router_logits' shortcut, checked on first use
        self._logits_dtype = (
            torch.float32
        )  # the dtype the router computes its logits in, when linear
        self._native_router: NativeTopKRouter | NativeSigmoidRouter | Literal[False] | None = (
            None  # decided on the first one-token step
        )
        # Routers that return their top-k in descending order (torch.topk's default, and the native router
        # standing in for them): the block need not sort them again.
        self.sorted_topk = type(getattr(native, self.router)).__name__ in ROUTER_CLASSES
        unknown = [
            n
            for n, c in native.named_children()
            if n not in ("experts", self.router, *self.known_children())
            and any(True for _ in c.parameters())
        ]
        if unknown:
            raise CheckpointError(
                f"model_type={model_type!r}: sparse block {type(native).__name__} has a part this engine does not "
                f"know how to run ({unknown[0]!r}); it needs an adapter in engine/weights/arch_adapters.py"
            )

    def known_children(self) -> tuple[str, ...]:
        return _SHARED

    @property
    def native_router(self) -> NativeTopKRouter | NativeSigmoidRouter | Literal[False] | None:
        """The native one-token router: None until the first one-token step decides, False where
        the router does not run natively (engine/native/router.py)."""
        return self._native_router

    def adopt(self, block: nn.Module, native: nn.Module) -> None:
        """Give `block` the native router, dense parts and buffers under their original names."""
        for name, child in native.named_children():
            if name != "experts":
                block.add_module(name, child)
        for name, buf in native.named_buffers(recurse=False):
            block.register_buffer(
                name, buf, persistent=name not in native._non_persistent_buffers_set
            )

    def route(
        self, block: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> router logits [T, E], top-k weights [T, k], top-k ids [T, k]."""
        # The router's forward straight from the module table: no hooks are registered on it, and
        # this runs once per layer in every decode step.
        router = block._modules[self.router]
        assert router is not None  # the block's router child (router_name found it)
        # The native router where it applies (engine/native/router.py), for every row of every step: each
        # row routed as it would be alone.
        if self._native_router is None:
            self.decide_native_router(block)
        if self._native_router:
            fast = self._native_router(x)
            if fast is not None:
                return fast
        logits, weights, ids = router.forward(x)
        return logits, weights, ids

    def decide_native_router(
        self, block: nn.Module
    ) -> NativeTopKRouter | NativeSigmoidRouter | Literal[False]:
        """The block's native one-token router (engine/native/router.py), or False where its router does not run
        natively; decided on first use."""
        if self._native_router is None:
            router = block._modules[self.router]
            assert router is not None
            self._native_router = (
                NativeTopKRouter(router)
                if NativeTopKRouter.supports(router)
                else NativeSigmoidRouter(router)
                if NativeSigmoidRouter.supports(router)
                else False
            )
        return self._native_router

    def router_logits(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] alone: what the prefetcher needs of the next layer's router on this
        layer's input (its FATE-like guess). Most routers' logits are one linear map of x, and
        computing just that skips the top-k selection route() also does (a grouped top-k and
        masks on DeepSeek-V3-style routers: most of the prefetcher's time per layer). Whether this
        router's logits are its linear map, in its weight's dtype or in float32 (as DeepSeek-V3-style
        routers compute), is checked against route() on the first call."""
        if self._logits_are_linear is False:
            return self.route(block, x)[0]
        w, b = self._weight_and_bias(block)
        if self._logits_are_linear is None:
            ref = self.route(block, x)[0]
            self._logits_are_linear = False
            if w is not None and w.dim() == 2 and w.shape[1] == x.shape[-1]:
                for dtype in (w.dtype, torch.float32):
                    out = self._linear(x, w, b, dtype)
                    if ref.shape == out.shape and bool(
                        torch.allclose(out.float(), ref.float(), rtol=1e-4, atol=1e-5)
                    ):
                        self._logits_are_linear, self._logits_dtype = True, dtype
                        break
            return ref
        return self._linear(x, w, b, self._logits_dtype)  # type: ignore[arg-type]

    @staticmethod
    def _linear(
        x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        return torch.nn.functional.linear(
            x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        )

    def _weight_and_bias(self, block: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The router's `weight` and `bias` tensors, each None where it has none."""
        router = getattr(block, self.router)
        w, b = getattr(router, "weight", None), getattr(router, "bias", None)
        return (w if isinstance(w, torch.Tensor) else None), (
            b if isinstance(b, torch.Tensor) else None
        )

    def router_linear(
        self, block: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight [E, H], bias or None) when this router's logits are its linear map of x (checked
        with `x`, a sample input, the first time), else None."""
        if self._logits_are_linear is None:
            self.router_logits(block, x)
        return self._weight_and_bias(block) if self._logits_are_linear else None  # type: ignore[return-value]

    def selection_scores(self, block: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        """What the router ranks to pick its top-k, for logits [T, E] (real or predicted).

        Softmax routers rank the logits themselves. DeepSeek-V3-style routers (glm4_moe, deepseek_v3,
        minimax_m2) rank sigmoid(logits) + a per-expert correction bias, the buffer that
        auxiliary-loss-free balancing trains; ranking their raw logits would miss every expert
        the bias lifts.
        """
        return router_ranking(logits, self.selection_bias(block))

    def selection_bias(self, block: nn.Module) -> torch.Tensor | None:
        """The per-expert correction bias [E] of a DeepSeek-V3-style router (float32), or None."""
        bias = getattr(getattr(block, self.router), "e_score_correction_bias", None)
        bias = getattr(block, "e_score_correction_bias", None) if bias is None else bias
        return None if bias is None else bias.float()

    def expert_inputs(
        self, x: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the executor runs: the experts' input rows and the weights scaling their outputs."""
        return x, weights

    def dense(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The dense part of the block (shared experts), added to the routed output."""
        # Looked up in the module table: getattr on an nn.Module raises (and catches) an
        # AttributeError for each missing name, several microseconds per layer of every step.
        modules = block._modules
        shared = modules.get("shared_expert")
        shared = modules.get("shared_experts") if shared is None else shared
        shared = modules.get("shared_mlp") if shared is None else shared
        if shared is None:
            return None
        out = shared(x)
        gate = modules.get("shared_expert_gate")
        if gate is None:
            return out
        g = gate(x)
        kernels = usable(out) if out.dim() == 2 and g.dtype == out.dtype else None
        if kernels is not None and g.is_contiguous():
            return kernels.sigmoid_gate(g, out)  # each row as it is alone (torch's sigmoid is not)
        return F.sigmoid(g) * out

    def output(
        self, out: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor | tuple:
        return out


def fused_expert_tensors(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse block's fused `experts.gate_up_proj` and `experts.down_proj` (3-D each)."""
    experts = block.experts
    assert isinstance(
        experts, nn.Module
    )  # a sparse block's `experts` child (router_name checked it)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    return gate_up, down


def expert_geometry(block: nn.Module, transposed: bool) -> tuple[int, int, int, int]:
    """(num_experts E, hidden H, intermediate I, top_k) of a sparse block.

    `gate_up_proj` is [E, 2I, H], or [E, H, 2I] for the transposed kernels (gpt-oss, Llama 4).
    """
    E, a, b = fused_expert_tensors(block)[0].shape
    H, two_i = (a, b) if transposed else (b, a)
    router = getattr(block, router_name(block) or "")
    top_k = getattr(router, "top_k", None) or getattr(block, "top_k", None)
    if top_k is None:
        raise CheckpointError(
            f"{type(block).__name__}: cannot tell how many experts its router picks (no top_k)"
        )
    return int(E), int(H), int(two_i) // 2, int(top_k)


def verify_block(
    native: nn.Module, adapter: BlockAdapter, kernel, model_type: str, seed: int = 0
) -> None:
    """Check once, for an architecture run by structure alone, that the generic hook computes what
    the block's own forward does: a random-weight float32 copy of the block, three random rows,
    through both. Raise CheckpointError, one line, naming what differs.

    The copy holds one block's experts in float32 for the moment of the check (freed at once)."""
    import copy

    test = copy.deepcopy(native).to_empty(device="cpu").float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in test.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g)
                * (0.5 if name.startswith(adapter.router or "-") else 0.05)
            )
        for _, b in test.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        gate_up, down = fused_expert_tensors(test)
        H = gate_up.shape[-1] if kernel.views[0][1][-1] == gate_up.shape[-1] else gate_up.shape[1]
        x = torch.randn(1, 3, H, generator=g)
        ref = test(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        rows = x.reshape(-1, H)
        _, weights, ids = adapter.route(test, rows)
        inputs, scale = adapter.expert_inputs(rows, weights)
        routed = torch.zeros_like(rows)
        for t in range(rows.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                w = [gate_up[e], down[e]]
                routed[t] += scale[t, k].float() * kernel.forward(w, inputs[t : t + 1])[0]
        dense = adapter.dense(test, rows)
        out = routed + (dense if dense is not None else 0)
        ref2 = ref.reshape(out.shape).float()
    if not torch.allclose(out, ref2, rtol=1e-4, atol=1e-5):
        only_routed = dense is not None and torch.allclose(routed, ref2, rtol=1e-4, atol=1e-5)
        what = (
            "its output equals the routed experts alone: it does not add its shared part as the hook does"
            if only_routed
            else "the routed experts (router weights, expert kernel) or the shared part combine differently"
        )
        raise CheckpointError(
            f"model_type={model_type!r}: sparse block {type(native).__name__} does not compute what the generic MoE hook does "
            f"(max |difference| {float((out - ref2).abs().max()):.2e} on a random row; {what}); it needs an adapter in engine/weights/arch_adapters.py"
        )
