"""The native routers' wrappers (engine/native/decode_layer.c `router_topk`, `router_sigmoid_rows`):
`RouteKernels`, the part of engine/native/kernels.py's `NativeKernels` that routes rows to experts."""

from __future__ import annotations

import torch

from engine.native.row_ops import X_CODES, KernelLibrary
from engine.native.structs import Router, Rows


class RouteKernels(KernelLibrary):
    def router_topk(
        self, x: torch.Tensor, w: torch.Tensor, k: int, norm: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A softmax top-k router for one row x [1, H] with weight w [E, H] (both f32 or both bf16,
        contiguous): (logits [1, E], top-k weights [1, k], ids [1, k]), as transformers' TopKRouter
        returns them, or None where the kernel does not apply."""
        E, H = w.shape
        logits = torch.empty((1, E), dtype=x.dtype)
        weights = torch.empty((1, k), dtype=x.dtype)
        ids = torch.empty((1, k), dtype=torch.int64)
        router = Router(
            k=k,
            norm=int(norm),
            logits=logits.data_ptr(),
            weights=weights.data_ptr(),
            ids=ids.data_ptr(),
        )
        rc = self._route("router_topk_call", x, w, router)
        return (logits, weights, ids) if rc == 0 else None

    def router_sigmoid(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        k: int,
        n_group: int,
        topk_group: int,
        norm: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A DeepSeek-V3-style router for rows x [R, H] (contiguous, f32 or bf16) with weight w [E, H] (f32 or bf16)
        and an f32 correction bias [E] or None (decode_layer.c `router_sigmoid_rows`: each row as `router_sigmoid`
        routes it alone): (logits [R, E], weights [R, k], ids [R, k]), logits and weights in f32 as transformers'
        Glm4Moe/DeepseekV3 TopkRouter returns them, or None where the kernel does not take the shape."""
        E, H = w.shape
        R = x.shape[0]
        logits, weights = torch.empty((R, E)), torch.empty((R, k))
        ids, xf = torch.empty((R, k), dtype=torch.int64), torch.empty(H)
        router = Router(
            k=k,
            norm=int(norm),
            n_group=n_group,
            topk_group=topk_group,
            scale=scale,
            bias=None if bias is None else bias.data_ptr(),
            logits=logits.data_ptr(),
            weights=weights.data_ptr(),
            ids=ids.data_ptr(),
            xf=xf.data_ptr(),
        )
        rc = self._route("router_sigmoid_rows_call", x, w, router)
        return (logits, weights, ids) if rc == 0 else None

    def _route(self, fn: str, x: torch.Tensor, w: torch.Tensor, router: Router) -> int:
        """Rows x through the router entry point `fn` with weight w [E, H], outputs where `router` says."""
        E, H = w.shape
        weight = self.weight_of(w)
        rows = Rows(x=x.data_ptr(), m=x.shape[0], n=H, xtype=X_CODES[x.dtype])
        work = self._work(self._scratch("gemv_work_bytes", E, H, 1))
        return int(
            getattr(self.lib, fn)(
                weight,
                rows,
                router,
                work,
                torch.get_num_threads(),
            )
        )
