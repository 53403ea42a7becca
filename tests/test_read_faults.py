"""Injected expert read faults (engine/experts/tiers/read_faults.py, --expert-read-faults): EIO fails only
the requests that needed the expert, with an `expert_read_failed` error; a short read is read to its
end and changes nothing; a latency spike only slows. The tiny checkpoint, a quarter of its experts
in the fast tier and the rest read from disk on every miss."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from engine_helpers import settle

from engine.config import EngineConfig
from engine.core.completion import Completion, complete, generate
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.faults import fault_class
from engine.errors import ConfigError
from engine.experts.tiers.read_faults import ReadFaults
from engine.experts.tiers.uncached_io import UncachedReader
from engine.read_fault_spec import FaultRule, parse_read_faults
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab) for _ in range(5 + 2 * i)] for i in range(n)]


def _run(ckpt: Path, faults: str, n: int = 4):
    """Load with `faults`, run n requests at once; returns (model, prompts, completions, seconds)."""
    cfg = EngineConfig(
        cache_fraction=0.25, offload="disk", warm_start=False, expert_read_faults=faults
    )
    om = load_model(ckpt, cfg)
    core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
    prompts = _prompts(om.config.vocab_size, n)
    t0 = time.perf_counter()
    outs = complete(core, [core.local_request(p, PARAMS) for p in prompts])
    return om, prompts, outs, time.perf_counter() - t0


def _exact_without_faults(om, prompts: list[list[int]], outs: list[Completion]) -> None:
    """Every request that completed has the tokens of a run with the faults off."""
    settle(om)
    om.transfers.tier.faults.armed = False
    for p, c in zip(prompts, outs):
        if c.finish_reason != "error":
            assert c.token_ids == generate(om, p, PARAMS).token_ids


def test_the_spec_parses_and_bad_specs_fail_with_one_line() -> None:
    rules = parse_read_faults("eio:every=50, delay:period=30:secs=3,short:p=0.2:seed=4")
    assert rules == (
        FaultRule("eio", every=50),
        FaultRule("delay", period=30.0, secs=3.0),
        FaultRule("short", p=0.2, seed=4),
    )
    for bad in ("", "enospc:p=1", "eio", "eio:p=1:every=2", "eio:p=2", "eio:every=x", "eio:q=1"):
        with pytest.raises(ConfigError, match="--expert-read-faults"):
            parse_read_faults(bad)
    with pytest.raises(ConfigError, match="--expert-read-faults"):
        EngineConfig(expert_read_faults="eio")  # checked with the other settings, before a load


def test_faults_fire_on_their_schedule_only_once_armed() -> None:
    faults = ReadFaults(parse_read_faults("eio:every=3:after=2"))
    faults.before_fetch(0, 0)  # disarmed (the load): nothing fires
    faults.arm()
    fired = []
    for i in range(1, 12):
        try:
            faults.before_fetch(0, i)
        except OSError as e:
            fired.append((i, e.errno))
    assert fired == [(5, 5), (8, 5), (11, 5)] and faults.counts["eio"] == 3
    timed = ReadFaults(parse_read_faults("delay:period=0.2:secs=0"))
    timed.arm()
    timed.before_fetch(0, 0)
    assert timed.counts["delay"] == 0  # not yet 0.2 s since it was armed
    time.sleep(0.25)
    timed.before_fetch(0, 0)
    timed.before_fetch(0, 0)
    assert timed.counts["delay"] == 1  # once in the period, not on every fetch after it


@pytest.mark.parametrize("direct", [False, True])
def test_a_short_read_is_read_to_its_end(tmp_path: Path, direct: bool) -> None:
    data = os.urandom(3 * 4096 + 100)
    (tmp_path / "f").write_bytes(data)
    reader = UncachedReader(prefer_direct=direct)
    reader.faults = faults = ReadFaults(parse_read_faults("short:p=1"))
    faults.arm()
    try:
        for offset, n in ((0, len(data)), (100, 9000), (4096, 3 * 4096 + 100 - 4096)):
            faults.before_fetch(0, 0)  # arms a cut of this thread's next read
            assert bytes(reader.read(tmp_path / "f", offset, n)) == data[offset : offset + n]
            faults.after_fetch()
        assert faults.counts["short"] == 3
    finally:
        reader.close()


def test_eio_fails_only_the_requests_that_needed_the_expert(tiny_ckpt) -> None:
    om, prompts, outs, _ = _run(tiny_ckpt(), "eio:every=5")
    try:
        failed = [c for c in outs if c.finish_reason == "error"]
        assert om.transfers.tier.faults.counts["eio"] >= 1 and failed
        for c in failed:
            assert fault_class(c.error) == "expert_read_failed"
            assert "Input/output error (injected)" in c.error and "/" not in c.error.split("(")[0]
        _exact_without_faults(om, prompts, outs)
        assert om.store.pinned_count() == 0 and om.transfers.pending() == 0
        after = generate(om, prompts[0], PARAMS)  # the engine goes on serving
        assert after.error is None and len(after.token_ids) == 6
    finally:
        om.close()


def test_short_reads_are_retried_and_change_no_token(tiny_ckpt) -> None:
    om, prompts, outs, _ = _run(tiny_ckpt(), "short:p=0.5")
    try:
        assert om.transfers.tier.faults.counts["short"] >= 3
        assert all(c.finish_reason != "error" for c in outs), [c.error for c in outs]
        _exact_without_faults(om, prompts, outs)
    finally:
        om.close()


def test_a_latency_spike_only_slows(tiny_ckpt) -> None:
    om, prompts, outs, seconds = _run(tiny_ckpt(), "delay:every=25:secs=0.5", n=2)
    try:
        fired = om.transfers.tier.faults.counts["delay"]
        assert fired >= 1 and seconds >= 0.5, (fired, seconds)
        assert all(c.finish_reason != "error" for c in outs), [c.error for c in outs]
        _exact_without_faults(om, prompts, outs)
    finally:
        om.close()
