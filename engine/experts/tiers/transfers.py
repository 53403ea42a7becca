"""Background expert transfers: slow tier -> fast-tier slot.

- A priority queue: demand loads (compute is waiting) before prefetches and admissions.
- De-duplication: a second request for an expert already in flight joins that transfer,
  and a demand request promotes a queued prefetch to demand priority.
- Cancellation of transfers that have not started (stale prefetches).
- Timing per transfer; the compute thread's blocking time is accounted as stall.
- On CUDA the copy runs on a dedicated stream and is ordered with an event, so the
  compute stream waits on the GPU, not the CPU.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.experts.cost_meter import CostMeter
from engine.experts.tiers.device_copy import CudaOps, SlotCopier
from engine.experts.tiers.expert_store import ExpertStore
from engine.experts.tiers.slow_tier import SlowTier
from engine.stats import EngineStats

PRIORITY = {"demand": 0, "admission": 1, "prefetch": 2}  # lower runs first


@dataclass(eq=False)
class Transfer:
    key: int
    layer: int
    expert: int
    kind: str
    slot: int
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    cancelled: bool = False
    error: BaseException | None = None
    cuda_event: Any = None  # torch.cuda.Event of the copy, on CUDA
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_end: float = 0.0
    nbytes: int = 0
    protect: bool = (
        False  # a prefetch: shield it from eviction once it lands, until used or expired
    )

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


class TransferEngine:
    def __init__(
        self,
        store: ExpertStore,
        tier: SlowTier,
        stats: EngineStats,
        num_experts: int,
        workers: int = 2,
        meter: CostMeter | None = None,
    ) -> None:
        self.store, self.tier, self.stats = store, tier, stats
        self.workers = workers
        self.meter = meter  # copy times feed the CPU/GPU balancer's cost model
        self.num_experts = num_experts
        self._queue: list[tuple[int, int, Transfer]] = []
        self._seq = itertools.count()
        self._inflight: dict[int, Transfer] = {}
        self._cv = threading.Condition(
            store.lock
        )  # one lock for residency + queue: no lock-order bugs
        self._closed = False
        self._landed = 0  # finished transfers, for waiters that need any slot to free up
        # On CUDA: one pinned copy per expert on a side stream (engine/experts/tiers/device_copy.py).
        slots = store.slots
        self.copier: SlotCopier | None = (
            SlotCopier(CudaOps(), slots.device, slots.shape[1], slots.dtype)
            if slots.is_cuda
            else None
        )
        self._threads = [
            threading.Thread(target=self._worker, name=f"expert-transfer-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    # -- API for the compute thread ------------------------------------------------
    def submit(
        self, layer: int, expert: int, kind: str, pin: bool = False, protect: bool = False
    ) -> Transfer | None:
        """Start (or join) a load. Returns None if resident already or no slot can be freed.

        With pin=True the caller also pins the expert and must unpin it after use (through
        an ExpertLease). With protect=True (prefetches) the landed expert is shielded from
        eviction until a plan uses it or the protection expires; it is counted as issued.
        Only demand loads may evict protected prefetches: a guess never displaces a guess.
        """
        key = self.key(layer, expert)
        with self._cv:
            t = self._inflight.get(key)
            if t is None:
                if self.store.state(key) is not None:  # resident
                    return None
                slot = self.store.reserve(key, may_evict_protected=kind == "demand")
                if slot is None:
                    return None
                t = Transfer(key, layer, expert, kind, slot, protect=protect)
                self._inflight[key] = t
                heapq.heappush(self._queue, (PRIORITY[kind], next(self._seq), t))
                self._cv.notify()
                if protect:
                    self.stats.add(prefetch_issued=1)
            elif PRIORITY[kind] < PRIORITY[t.kind]:
                if t.protect:  # compute needs what was prefetched: the prediction paid off
                    t.protect = False
                    self.stats.add(prefetch_used=1)
                if not t.started:
                    t.kind = kind  # promote; the stale heap entry is skipped by the worker
                    heapq.heappush(self._queue, (PRIORITY[kind], next(self._seq), t))
                    self._cv.notify()
            if pin:
                self.store.pin(key)
            return t

    def cancel(self, layer: int, expert: int) -> bool:
        """Cancel a queued transfer. Returns False if it already started or is unknown."""
        key = self.key(layer, expert)
        with self._cv:
            t = self._inflight.get(key)
            if t is None or t.started:
                return False
            t.cancelled = True
            del self._inflight[key]
            self.store.abort(key)
            self.stats.record_cancel()
            t.done.set()
            return True

    def wait(self, t: Transfer) -> None:
        """Block until `t` lands; the blocked time is stall. Raises the transfer's error, if any."""
        if not t.done.is_set():
            t0 = time.perf_counter()
            t.done.wait()
            self.stats.record_stall(time.perf_counter() - t0, t.layer)
        if t.error is not None:
            raise t.error
        if t.cuda_event is not None and self.copier is not None:
            self.copier.order(t.cuda_event)

    def wait_for_any_landing(self, timeout: float = 30.0, layer: int | None = None) -> bool:
        """Block until some in-flight transfer finishes (its slot becomes evictable again).
        Returns whether a retry can succeed: False only when nothing is in flight and no slot
        is free or evictable (every slot pinned by its users)."""
        with self._cv:
            if not self._inflight:
                return self.store.has_room()
            n = self._landed
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: self._landed != n or not self._inflight, timeout)
        self.stats.record_stall(time.perf_counter() - t0, layer)
        return True

    def settle(self, layer: int | None = None) -> None:
        """Block until no background load (admission or prefetch) is in flight: the deterministic
        point at which they take effect (EngineConfig.settle_background). The wait counts as stall."""
        with self._cv:
            if not any(t.kind != "demand" for t in self._inflight.values()):
                return
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: not any(t.kind != "demand" for t in self._inflight.values()))
        self.stats.record_stall(time.perf_counter() - t0, layer)

    def queued(self, kind: str) -> list[tuple[int, int]]:
        """(layer, expert) of the transfers of `kind` that have not started (cancellable)."""
        with self._cv:
            return [
                (t.layer, t.expert)
                for t in self._inflight.values()
                if t.kind == kind and not t.started
            ]

    def cancel_queued(self, kind: str, stale: Callable[[int, int], bool]) -> None:
        """Cancel the transfers of `kind` that have not started and for which stale(layer, expert)."""
        for layer, e in self.queued(kind):
            if stale(layer, e):
                self.cancel(layer, e)

    def in_flight(self, layer: int, expert: int) -> bool:
        with self._cv:
            return self.key(layer, expert) in self._inflight

    def pending(self) -> int:
        with self._cv:
            return len(self._inflight)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self.tier.close()

    # -- worker side -----------------------------------------------------------------
    def _next(self) -> Transfer | None:
        with self._cv:
            while True:
                while self._queue:
                    _, _, t = heapq.heappop(self._queue)
                    if not t.cancelled and not t.started:
                        t.started = True
                        return t
                if self._closed:
                    return None
                self._cv.wait()

    def _worker(self) -> None:
        while (t := self._next()) is not None:
            t.t_start = time.perf_counter()
            try:
                dst = self.store.slots[t.slot]
                if self.copier is not None:  # the compute stream waits on the event, on the GPU
                    t.nbytes, t.cuda_event = self.copier.land(self.tier, t.layer, t.expert, dst)
                else:
                    host, t.nbytes = self.tier.fetch(t.layer, t.expert, into=dst)
                    if host is not dst:  # else the tier assembled the expert in its slot already
                        _host_copy(dst, host)
            except BaseException as e:  # surfaced to the waiter, never swallowed
                t.error = e
            t.t_end = time.perf_counter()
            with self._cv:
                if t.error is None:
                    self.store.commit(t.key)
                    if t.protect:
                        self.store.protect(t.key)
                    self.store.unpin(t.key)  # the reservation's pin; consumers hold their own
                    self.stats.record_transfer(t.kind, t.nbytes, t.seconds)
                    if self.meter is not None:
                        self.meter.record_copy(t.seconds)
                else:
                    self.store.abort(t.key)
                self._inflight.pop(t.key, None)
                self._landed += 1
                self._cv.notify_all()
            t.done.set()


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a fetched expert into its slot, host to host, on this transfer thread alone.

    Why not `dst.copy_(src)`: torch runs a large copy as an OpenMP parallel region, and a
    region started from a second OS thread gets its own team of OpenMP threads, which then
    compete with the compute thread's team for the same cores: on the 2-core box an engine
    decoding at 2 threads lost its whole second-thread gain once transfers had run
    (docs/benchmarks/peers.md). A byte copy through numpy is single-threaded and releases the GIL.
    """
    if (
        dst.dtype != src.dtype
        or not (dst.is_contiguous() and src.is_contiguous())
        or dst.device.type != "cpu"
    ):
        dst.copy_(src)  # a conversion, or a device copy: torch's own path
        return
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
