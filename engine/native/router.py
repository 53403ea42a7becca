"""The softmax top-k router of a one-token step in one native call.

Why: transformers' TopKRouter is seven torch calls (reshape, linear, softmax, topk, sum, divide,
cast). Right after a layer's experts have streamed megabytes of weights through the cache, each
of those calls runs cold, and the router cost about 125 us a layer on the tiny peers checkpoint,
more than the experts' own Python. engine/native/cpu_gemv.c's `router_topk` does the same
arithmetic in one call.

Which routers: Qwen2-MoE, Qwen3-MoE and OLMoE's `TopKRouter` (the same forward in transformers 5:
softmax in f32, top-k, optional renormalisation, cast back), one row at a time, f32 or bf16, on the
CPU. Its sums run in another order than torch's, so each router's first native result is checked
against its own forward (same experts, weights and logits within rounding); a router that does not
match keeps its forward.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.native.kernels import X_CODES, native

ROUTER_CLASSES = frozenset({"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter"})


class NativeTopKRouter:
    def __init__(self, router: nn.Module) -> None:
        self.router = router
        self.verified: bool | None = None  # None: not checked yet
        self._accepted: torch.dtype | None = None  # the input dtype last found to run natively
        # Read once: module attribute lookups cost microseconds, and a missing one raises inside getattr.
        self.weight: torch.Tensor = router.weight  # the Parameter itself: its data pointer is read at each call
        self.top_k: int = router.top_k
        self.norm = bool(getattr(router, "norm_topk_prob", True))

    @staticmethod
    def supports(router: nn.Module) -> bool:
        w = getattr(router, "weight", None)
        return (type(router).__name__ in ROUTER_CLASSES and isinstance(w, torch.Tensor) and w.dim() == 2
                and getattr(router, "bias", None) is None and isinstance(getattr(router, "top_k", None), int)
                and native() is not None)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [1, H] -> (logits, weights, ids) as the router's forward returns them, or None (use it)."""
        w = self.weight
        # Every layer of every decode step comes here with the same kind of row: after the first
        # accepted one, only what can change from a call to the next is checked.
        if self._accepted is not x.dtype or x.shape[0] != 1 or not x.is_contiguous() or self.verified is False:
            if (self.verified is False or x.shape[0] != 1 or x.dtype != w.dtype or x.dtype not in X_CODES
                    or x.device.type != "cpu" or not x.is_contiguous() or not w.is_contiguous() or native() is None):
                return None
            self._accepted = x.dtype
        got = native().router_topk(x, w, self.top_k, self.norm)
        if got is None or self.verified:
            return got
        ref = self.router.forward(x)
        tol = 1e-5 if x.dtype == torch.float32 else 2 ** -7
        self.verified = (torch.equal(got[2], ref[2]) and all(a.dtype == b.dtype for a, b in zip(got, ref))
                         and all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in zip(got[:2], ref[:2])))
        return ref
