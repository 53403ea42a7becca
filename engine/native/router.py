"""The softmax top-k router of a one-token step in one native call.

Why: transformers' TopKRouter is seven torch calls (reshape, linear, softmax, topk, sum, divide,
cast). Right after a layer's experts have streamed megabytes of weights through the cache, each
of those calls runs cold, and the router cost about 125 us a layer on the tiny peers checkpoint,
more than the experts' own Python. engine/native/cpu_gemv.c's `router_topk` does the same
arithmetic in one call.

Which routers: Qwen2-MoE, Qwen3-MoE and OLMoE's `TopKRouter` (the same forward in transformers 5:
softmax in f32, top-k, optional renormalisation, cast back), one row at a time, f32 or bf16, on the
CPU. Its sums run in another order than torch's, so each router's first native result is checked
against its own forward (`same_routing`: logits and weights within rounding, the same experts except
where two tie to rounding); a router that does not match keeps its forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.native.kernels import X_CODES
from engine.native.limits import MAX_TOPK
from engine.native.loaded import native
from engine.native.row_kernels import native_rows_allowed

ROUTER_CLASSES = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter"})
# DeepSeek-V3-style routers (sigmoid scores, a correction bias, grouped top-k): decode_layer.c `router_sigmoid`.
SIGMOID_ROUTERS = frozenset({"Glm4MoeTopkRouter", "DeepseekV3TopkRouter"})


class NativeTopKRouter:
    def __init__(self, router: Any) -> None:
        self.router = router
        self.verified: bool | None = None  # None: not checked yet
        self._accepted: torch.dtype | None = None  # the input dtype last found to run natively
        # Read once: module attribute lookups cost microseconds, and a missing one raises inside getattr.
        self.weight: torch.Tensor = (
            router.weight
        )  # the Parameter itself: its data pointer is read at each call
        self.top_k: int = router.top_k
        self.norm = bool(getattr(router, "norm_topk_prob", True))

    @staticmethod
    def supports(router: nn.Module) -> bool:
        w = getattr(router, "weight", None)
        return (
            type(router).__name__ in ROUTER_CLASSES
            and isinstance(w, torch.Tensor)
            and w.dim() == 2
            and getattr(router, "bias", None) is None
            and isinstance(getattr(router, "top_k", None), int)
            and native() is not None
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [n, H] -> (logits, weights, ids) as the router's forward returns them, or None (use it). Several
        rows (a verification window, a batch's decode rows) run one native call each, and only in a step
        whose rows take the native kernels (engine/native/row_kernels.py): each row then routes as it
        would alone, where torch's result for a row depends on the rows beside it."""
        if x.shape[0] == 1:
            return self._one(x)
        if not native_rows_allowed() or not x.is_contiguous():
            return None
        rows = [self._one(x[r : r + 1]) for r in range(x.shape[0])]
        if any(r is None for r in rows):
            return None
        return tuple(torch.cat(parts) for parts in zip(*rows))  # type: ignore[return-value]

    def _one(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        w = self.weight
        # Every layer of every decode step comes here with the same kind of row: after the first
        # accepted one, only what can change from a call to the next is checked.
        if self._accepted is not x.dtype or not x.is_contiguous() or self.verified is False:
            if (
                self.verified is False
                or x.dtype != w.dtype
                or x.dtype not in X_CODES
                or x.device.type != "cpu"
                or not x.is_contiguous()
                or not w.is_contiguous()
                or native() is None
            ):
                return None
            self._accepted = x.dtype
        kernels = native()
        assert kernels is not None  # checked above
        got = kernels.router_topk(x, w, self.top_k, self.norm)
        if got is None or self.verified:
            return got
        ref = self.router.forward(x)
        self.verified = same_routing(got, ref, 1e-5 if x.dtype == torch.float32 else 2**-7)
        # The native result once it passed: every call, the first too, routes one way.
        return got if self.verified else ref


class NativeSigmoidRouter:
    """A DeepSeek-V3-style router (SIGMOID_ROUTERS) run natively row by row, as the fused step runs it
    (engine/worker/fused_layer_spec.py): each row routed as it would be alone, where torch's f32 linear
    over the step's rows sums a row in an order that depends on the rows beside it. Checked on its first
    call against the router's own forward (as sets of experts: these routers' top-k order is unspecified)."""

    def __init__(self, router: Any) -> None:
        self.router = router
        bias = getattr(router, "e_score_correction_bias", None)
        self.bias = (
            bias.detach().float().contiguous() if bias is not None else None
        )  # f32, as it adds it
        self.top_k, self.groups, self.keep = router.top_k, router.num_group, router.topk_group
        self.norm, self.scale = bool(router.norm_topk_prob), float(router.routed_scaling_factor)
        self.verified: bool | None = None

    @staticmethod
    def supports(router: nn.Module) -> bool:
        w = getattr(router, "weight", None)
        return (
            type(router).__name__ in SIGMOID_ROUTERS
            and isinstance(w, torch.Tensor)
            and w.dim() == 2
            and w.dtype in (torch.float32, torch.bfloat16)
            and w.device.type == "cpu"
            and w.is_contiguous()
            and getattr(router, "top_k", MAX_TOPK + 1) <= MAX_TOPK
            and native() is not None
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [n, H] -> (logits, weights, ids) in f32 / f32 / int64, or None (use the router's forward)."""
        kernels = native()
        if (
            kernels is None
            or self.verified is False
            or not native_rows_allowed()
            or x.dtype not in X_CODES
            or x.device.type != "cpu"
            or not x.is_contiguous()
        ):
            return None
        w = self.router.weight
        args = (self.bias, self.top_k, self.groups, self.keep, self.norm, self.scale)
        got = kernels.router_sigmoid(x, w, *args)  # each row as it is routed alone, in one call
        if got is None:
            return None
        if self.verified is None:
            self.verified = same_routing(by_id(got), by_id(self.router.forward(x)), 1e-5)
            if not self.verified:
                return None
        return got


def by_id(
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, weights, ids) with the top-k in ascending expert order: DeepSeek-V3-style routers take
    topk(sorted=False), whose order is unspecified, so two results compare as sets."""
    logits, weights, ids = routing
    order = torch.argsort(ids, dim=1)
    return logits, weights.gather(1, order), ids.gather(1, order)


def same_routing(
    got: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tol: float,
) -> bool:
    """Whether (logits, weights, ids) `got` is the router's own result `ref` up to rounding: the same
    dtypes, logits and top-k weights within `tol`, and the same experts wherever the reference's logits
    tell them apart by more than `tol`. Why the last clause: where two experts' logits tie to rounding
    (it happened on a random checkpoint's router), the other summation order may rank them the other
    way; that is a rounding difference, not another router, and refusing it kept the router (and the
    fused decode step) off for good."""
    if not all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip(got, ref)):
        return False
    logits = ref[0].float()
    # Each logit is a sum of H products whose rounding error scales with the largest terms, not with the
    # sum: a logit near zero among large ones (a random checkpoint's deep layers) differed by 1.5e-5 in
    # f32. So the logits' tolerance is relative to the largest of them.
    atol = tol * max(1.0, float(logits.abs().max()))
    if not (
        torch.allclose(got[0].float(), logits, rtol=tol, atol=atol)
        and torch.allclose(got[1].float(), ref[1].float(), rtol=tol, atol=tol)
    ):
        return False
    if torch.equal(got[2], ref[2]):
        return True
    return bool(
        torch.allclose(logits.gather(1, got[2]), logits.gather(1, ref[2]), rtol=tol, atol=atol)
    )
