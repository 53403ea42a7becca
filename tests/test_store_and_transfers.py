"""Fast-tier slots, eviction, and the background transfer engine, on a fake slow tier."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.errors import ConfigError
from engine.experts.tiers.expert_store import ExpertStore
from engine.experts.tiers.link import EmulatedLink, parse_link
from engine.experts.tiers.transfers import TransferEngine
from engine.stats import EngineStats
from policies.lru import LRUEviction

NUMEL = 16


class FakeTier:
    """A slow tier whose fetches can be held back by a gate, and that counts calls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.delay = delay
        self.fail_on: set[tuple[int, int]] = set()

    def fetch(
        self, layer: int, expert: int, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        self.gate.wait()
        time.sleep(self.delay)
        self.calls.append((layer, expert))
        if (layer, expert) in self.fail_on:
            raise OSError(f"read failed for {layer}/{expert}")
        return torch.full((NUMEL,), float(layer * 100 + expert)), NUMEL * 4

    def close(self) -> None:
        pass


def make(n_slots: int = 2, workers: int = 1, delay: float = 0.0):
    stats = EngineStats(num_layers=2)
    store = ExpertStore(n_slots, NUMEL, torch.float32, torch.device("cpu"), LRUEviction(), stats)
    tier = FakeTier(delay)
    te = TransferEngine(store, tier, stats, num_experts=8, workers=workers)
    return store, tier, te, stats


def drain(te: TransferEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while te.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert te.pending() == 0, "transfers did not finish"


def load(te: TransferEngine, layer: int, expert: int, pin: bool = False):
    t = te.submit(layer, expert, "demand", pin=pin)
    assert t is not None
    te.wait(t)
    return t


def test_load_copies_expert_into_slot() -> None:
    store, _, te, stats = make()
    load(te, 1, 3)
    key = te.key(1, 3)
    assert store.is_resident(key)
    assert torch.equal(store.weights(key), torch.full((NUMEL,), 103.0))
    assert stats.snapshot()["bytes_moved"] == NUMEL * 4
    te.close()


def test_eviction_under_pressure_is_lru_and_spares_pinned() -> None:
    store, _, te, stats = make(n_slots=2)
    load(te, 0, 0)
    load(te, 0, 1)
    store.touch(te.key(0, 0))  # 0 is now most recent, so 1 is the LRU victim
    load(te, 0, 2)
    assert store.is_resident(te.key(0, 0)) and store.is_resident(te.key(0, 2))
    assert not store.is_resident(te.key(0, 1))
    assert stats.snapshot()["evictions"] == 1
    # Pin both residents: a further load cannot take a slot until one is released.
    store.pin(te.key(0, 0))
    store.pin(te.key(0, 2))
    assert te.submit(0, 3, "demand") is None
    store.unpin(te.key(0, 2))
    load(te, 0, 3)
    assert store.is_resident(te.key(0, 0)), "a pinned expert was evicted"
    assert not store.is_resident(te.key(0, 2))
    te.close()


def test_concurrent_requests_for_one_expert_are_deduplicated() -> None:
    store, tier, te, _ = make(n_slots=4, workers=2)
    tier.gate.clear()
    results = []

    def request() -> None:
        t = te.submit(0, 5, "demand", pin=True)
        te.wait(t)
        results.append(t)

    threads = [threading.Thread(target=request) for _ in range(8)]
    for th in threads:
        th.start()
    time.sleep(0.05)
    tier.gate.set()
    for th in threads:
        th.join(timeout=5)
    assert len(results) == 8 and len({id(t) for t in results}) == 1
    assert tier.calls == [(0, 5)], "the expert must be read once"
    te.close()


def test_cancel_queued_prefetch_frees_its_slot() -> None:
    store, tier, te, stats = make(n_slots=3, workers=1)
    tier.gate.clear()
    blocker = te.submit(0, 0, "demand")  # occupies the only worker
    time.sleep(0.05)
    queued = te.submit(0, 1, "prefetch")
    assert queued is not None and not queued.started
    assert te.cancel(0, 1) is True
    assert te.cancel(0, 1) is False  # already gone
    assert store.state(te.key(0, 1)) is None
    tier.gate.set()
    te.wait(blocker)
    time.sleep(0.05)
    assert (0, 1) not in tier.calls
    assert stats.snapshot()["transfers_cancelled"] == 1
    assert te.cancel(0, 0) is False  # finished transfers cannot be cancelled
    te.close()


def test_demand_jumps_ahead_of_prefetches() -> None:
    store, tier, te, _ = make(n_slots=6, workers=1)
    tier.gate.clear()
    te.submit(0, 0, "prefetch")
    time.sleep(0.05)  # the worker is now holding `first`
    for e in (1, 2, 3):
        te.submit(0, e, "prefetch")
    demand = te.submit(0, 4, "demand")
    tier.gate.set()
    te.wait(demand)
    drain(te)
    assert tier.calls[:2] == [(0, 0), (0, 4)]
    te.close()


def test_demand_promotes_a_queued_prefetch() -> None:
    store, tier, te, stats = make(n_slots=6, workers=1)
    tier.gate.clear()
    te.submit(0, 0, "prefetch")
    time.sleep(0.05)
    te.submit(0, 1, "prefetch")
    te.submit(0, 2, "prefetch")
    promoted = te.submit(0, 2, "demand", pin=True)
    assert promoted.kind == "demand"
    tier.gate.set()
    te.wait(promoted)
    drain(te)
    assert tier.calls.index((0, 2)) < tier.calls.index((0, 1))
    te.close()


def test_failed_transfer_raises_in_waiter_and_frees_slot() -> None:
    store, tier, te, _ = make()
    tier.fail_on.add((1, 1))
    t = te.submit(1, 1, "demand", pin=True)
    with pytest.raises(OSError, match="read failed"):
        te.wait(t)
    assert store.state(te.key(1, 1)) is None
    load(te, 1, 2)  # the engine keeps working
    te.close()


def test_stall_time_is_measured() -> None:
    store, tier, te, stats = make(delay=0.1)
    load(te, 0, 0)
    snap = stats.snapshot()
    assert 0.08 <= snap["stall_seconds"] < 2.0
    assert snap["transfer_seconds"]["demand"] >= 0.09
    te.close()


def test_emulated_link_serializes_transfers() -> None:
    link = EmulatedLink(parse_link("1:0"))  # 1 MB/s, no latency
    t0 = time.monotonic()
    d1 = link.reserve(50_000)  # 50 ms
    d2 = link.reserve(50_000)  # queues behind the first
    assert d1 - t0 == pytest.approx(0.05, abs=0.01)
    assert d2 - d1 == pytest.approx(0.05, abs=0.01)


def test_link_parsing() -> None:
    assert parse_link("nvme").mb_per_s == 3000.0
    spec = parse_link("200MB/s,500us")
    assert (spec.mb_per_s, spec.latency_us) == (200.0, 500.0)
    assert spec.seconds_for(2_000_000) == pytest.approx(0.0105)
    for bad in ("fast", "0", "-5:3"):
        with pytest.raises(ConfigError, match="--link"):
            parse_link(bad)
