"""CPU-run experts (MoE-SpAc): a missed expert computed by CPU worker threads straight from the
host tier, instead of being copied into a fast-tier slot.

On a GPU box the expert's rows go to the host, the CPU computes them against the host copy of
the weights (no transfer over PCIe, no slot taken, nothing evicted) and the result goes back,
while the GPU computes the resident experts. On a CPU-only box the "fast device" and the CPU
are the same hardware: the path still skips the slot copy and the eviction, and runs in
parallel with the compute thread, but the benefit MoE-SpAc reports needs a real GPU.

Exactness: on a CPU box the weights are converted to the slot's dtype exactly as a copy into a
slot would (or used in place when the host tier already holds them in that dtype), and the same
kernel runs as for a slot: the native one for decode and verification rows where it applies
(engine/experts/compute/native_moe.py; decided on the scheduler thread, whose step sets which rows take
it), else the format's torch path. So the result is bit-identical to the copied path. On a GPU
box plain float experts compute in f32 on the CPU (bf16 matmuls are slow there), then the result
is cast back: close to the GPU's result, not equal to it. The disk tier's reads go
through the same emulated link as a transfer: on disk, the read is the cost either way.
"""

from __future__ import annotations

import contextvars
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.experts.compute.native_moe import NativeMoe
from engine.experts.compute.native_mxfp4 import native_experts
from engine.experts.cost_meter import CostMeter
from engine.experts.formats.quant import ExpertFormat, PlainFormat
from engine.experts.tiers.slow_tier import SlowTier
from engine.stats import EngineStats


class CpuExperts:
    def __init__(
        self, tier: SlowTier, fmt: ExpertFormat, workers: int, meter: CostMeter, stats: EngineStats
    ) -> None:
        self.tier, self.fmt, self.meter, self.stats = tier, fmt, meter, stats
        self.workers = workers
        kernel = fmt.kernel
        self.native: NativeMoe | None = native_experts(fmt, kernel.hidden, kernel.intermediate)
        # On a GPU box plain float experts compute in fp32 on the CPU (bf16 matmuls are slow there);
        # quantized slots keep their byte layout and dequantize in the format's own compute dtype.
        self.weight_dtype = (
            torch.float32
            if isinstance(fmt, PlainFormat) and fmt.slot_dtype != "float32"
            else getattr(torch, fmt.slot_dtype)
        )
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="cpu-expert")
        self._local = threading.local()

    def submit(self, layer: int, expert: int, x: torch.Tensor) -> Future[torch.Tensor]:
        """Compute expert `expert` of `layer` over rows x [n, H] on a CPU worker; the future's
        result is the unscaled expert output [n, H] on x's device and in x's dtype. Which kernel
        runs is decided here, on the caller's thread (its step says which rows take the native ones)."""
        # The worker runs in a copy of the caller's context: which rows take the native kernels is a
        # context variable of the step (engine/native/row_kernels.py), and a pool thread's own context
        # would hold its default.
        ctx = contextvars.copy_context()
        if x.device.type == "cpu":  # a CPU box: the slot's own dtype and kernel, so the same result
            native = self.native is not None and self.native.accepts(x)
            return self._pool.submit(
                ctx.run,
                self._run,
                layer,
                expert,
                x,
                device=x.device,
                dtype=x.dtype,
                weight_dtype=getattr(torch, self.fmt.slot_dtype),
                native=native,
            )
        x_host = x.to("cpu", torch.float32)
        return self._pool.submit(
            ctx.run,
            self._run,
            layer,
            expert,
            x_host,
            device=x.device,
            dtype=x.dtype,
            weight_dtype=self.weight_dtype,
            native=False,
        )

    def _run(
        self,
        layer: int,
        expert: int,
        x: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        weight_dtype: torch.dtype,
        native: bool,
    ) -> torch.Tensor:
        t0 = time.perf_counter()
        host, _ = self.tier.fetch(layer, expert)
        views = self.fmt.views(self._weights(host, weight_dtype))
        if native:
            assert self.native is not None  # submit checked
            y = self.native.rows(x, self.native.pointers(views))
        else:
            y = self.fmt.forward(views, x)
        self.meter.record_cpu(x.shape[0], time.perf_counter() - t0)
        self.stats.add(cpu_expert_calls=1)
        return y.to(device, dtype)

    def _weights(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer in `dtype`: in place when it already is (the RAM tier stores slot-ready
        rows), else converted into this worker's scratch row."""
        if host.dtype == dtype and host.device.type == "cpu":
            return host
        scratch = getattr(self._local, "row", None)
        if scratch is None or scratch.numel() != host.numel() or scratch.dtype != dtype:
            scratch = self._local.row = torch.empty(host.numel(), dtype=dtype)
        scratch.copy_(host)
        return scratch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
