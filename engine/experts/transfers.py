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
from dataclasses import dataclass, field

import torch

from engine.experts.expert_store import ExpertStore
from engine.experts.slow_tier import SlowTier
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
    cuda_event: "torch.cuda.Event | None" = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_end: float = 0.0
    nbytes: int = 0

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
    ) -> None:
        self.store, self.tier, self.stats = store, tier, stats
        self.num_experts = num_experts
        self._queue: list[tuple[int, int, Transfer]] = []
        self._seq = itertools.count()
        self._inflight: dict[int, Transfer] = {}
        self._cv = threading.Condition(store.lock)  # one lock for residency + queue: no lock-order bugs
        self._closed = False
        self._stream = torch.cuda.Stream(device=store.slots.device) if store.slots.is_cuda else None
        self.history: list[Transfer] = []  # finished transfers, for benchmarks (bounded below)
        self._threads = [threading.Thread(target=self._worker, name=f"expert-transfer-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    # -- API for the compute thread ------------------------------------------------
    def submit(self, layer: int, expert: int, kind: str, pin: bool = False) -> Transfer | None:
        """Start (or join) a load. Returns None if resident already or no slot can be freed.

        With pin=True the caller also pins the expert and must `store.unpin` it after use.
        """
        key = self.key(layer, expert)
        with self._cv:
            t = self._inflight.get(key)
            if t is None:
                if self.store.state(key) is not None:  # resident
                    return None
                slot = self.store.reserve(key)
                if slot is None:
                    return None
                t = Transfer(key, layer, expert, kind, slot)
                self._inflight[key] = t
                heapq.heappush(self._queue, (PRIORITY[kind], next(self._seq), t))
                self._cv.notify()
            elif PRIORITY[kind] < PRIORITY[t.kind] and not t.started:
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
            self.stats.record_stall(time.perf_counter() - t0)
        if t.error is not None:
            raise t.error
        if t.cuda_event is not None:
            torch.cuda.current_stream(self.store.slots.device).wait_event(t.cuda_event)

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
                host, t.nbytes = self.tier.fetch(t.layer, t.expert)
                dst = self.store.slots[t.slot]
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        dst.copy_(host, non_blocking=True)
                        t.cuda_event = torch.cuda.Event()
                        t.cuda_event.record(self._stream)
                    t.cuda_event.synchronize()  # keeps `host` alive until the copy has read it
                else:
                    dst.copy_(host)
            except BaseException as e:  # surfaced to the waiter, never swallowed
                t.error = e
            t.t_end = time.perf_counter()
            with self._cv:
                if t.error is None:
                    self.store.commit(t.key)
                    self.store.unpin(t.key)  # the reservation's pin; consumers hold their own
                    self.stats.record_transfer(t.kind, t.nbytes, t.seconds)
                else:
                    self.store.abort(t.key)
                self._inflight.pop(t.key, None)
                self.history.append(t)
                if len(self.history) > 100_000:
                    del self.history[:50_000]
            t.done.set()
