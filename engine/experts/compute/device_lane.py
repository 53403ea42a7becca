"""The resident lane with every index kept on the device: a decode row's routed experts run with no
read of the router's choice to the host, so on a GPU an MoE layer makes no host synchronization.

The host lane (MoeExecutor._resident_lane) reads the row's expert ids and gate weights to host
lists, then loops over the experts: on a GPU each of those two reads waits for the device, twice
per MoE layer per decode step (docs/benchmarks/gpu_check.md counted 18.8 stream synchronizations
per token). Here the expert ids index a slot table on the device, the k slots are gathered from
the pool, and the experts run as two batched GEMVs. The gather copies the k experts' weights once
more on the device, which a GPU's memory bandwidth pays for cheaply and a CPU's does not: the
executor takes this lane on CUDA only (the native CPU kernels make no host read either).

Only while store.complete: every expert resident for good, so the slot table, made once, never
goes stale.
"""

from __future__ import annotations

import torch

from engine.experts.formats.expert_kernels import SwiGLUKernel
from engine.experts.formats.quant import ExpertFormat, PlainFormat
from engine.experts.tiers.expert_store import ExpertStore


class DeviceLane:
    def __init__(self, store: ExpertStore, kernel: SwiGLUKernel, num_experts: int) -> None:
        self.store, self.kernel, self.num_experts = store, kernel, num_experts
        (_, (two_i, h)), _ = kernel.views
        self.hidden, self.intermediate = h, two_i // 2
        self._table: torch.Tensor | None = None

    @staticmethod
    def supports(fmt: ExpertFormat) -> bool:
        """Plain (unquantized) SwiGLU slots: [gate | up] rows then down, readable as batched matrices."""
        return isinstance(fmt, PlainFormat) and type(fmt.kernel) is SwiGLUKernel

    def slot_table(self) -> torch.Tensor:
        """[keys] slot index of every expert key (layer * E + expert), on the slots' device; made on
        first use, after the store became complete."""
        if self._table is None:
            assert self.store.complete, "the device lane needs every expert resident for good"
            slot_of = self.store.res.slot_of
            table = torch.full((max(slot_of) + 1,), -1, dtype=torch.long)
            for key, slot in slot_of.items():
                table[key] = slot
            self._table = table.to(self.store.slots.device)
        return self._table

    def run(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [1, H] through its routed experts ids [1, k], each scaled by weights [1, k]; -> [1, H].
        Experts are summed in ascending id order, as transformers sums them."""
        H, I = self.hidden, self.intermediate
        order = torch.argsort(ids[0])  # [k]
        keys = ids[0][order] + layer * self.num_experts
        w = weights[0][order]
        pool = self.store.slots.index_select(0, self.slot_table()[keys])  # [k, 3*I*H]
        k = pool.shape[0]
        gate_up = pool[:, : 2 * I * H].view(k, 2 * I, H)
        down = pool[:, 2 * I * H :].view(k, H, I)
        gate, up = torch.bmm(gate_up, x.expand(k, H).unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(down, (self.kernel.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)  # [k, H]
        y = (y * w[:, None]).to(x.dtype)
        return y.sum(dim=0, keepdim=True)
