from __future__ import annotations

import os

import pytest

from engine.errors import CheckpointError
from engine.experts.tiers.uncached_io import UncachedReader


def _supports_o_direct(path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("prefer_direct", [True, False])
def test_reads_exact_bytes_at_unaligned_offsets(
    tmp_path, prefer_direct: bool, scratch: bool
) -> None:
    data = os.urandom(3 * 4096 + 123)
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    r = UncachedReader(prefer_direct=prefer_direct)
    for off, n in [(0, 10), (1, 4096), (4095, 2), (5000, 7000), (len(data) - 5, 5)]:
        assert bytes(r.read(f, off, n, scratch=scratch)) == data[off : off + n]
    # The mode used is the one this file system allows: probe O_DIRECT independently.
    assert r.modes[str(f)] == (
        "O_DIRECT" if prefer_direct and _supports_o_direct(f) else "pread+DONTNEED"
    )
    with pytest.raises(CheckpointError, match="truncated"):
        r.read(f, len(data) - 5, 50)
    clock = r.clock.snapshot()  # the five reads that delivered, not the truncated one
    assert (clock["reads"], clock["bytes"]) == (5, 10 + 4096 + 2 + 7000 + 5)
    r.close()


def test_read_clock_counts_overlapping_reads_once() -> None:
    """Two reads in flight at once add their overlap to the busy time once, not twice."""
    import time

    from engine.experts.tiers.uncached_io import ReadClock

    clock = ReadClock()
    t0 = time.perf_counter()
    clock.start()
    clock.start()
    time.sleep(0.02)
    clock.stop(100)
    clock.stop(200)
    wall = time.perf_counter() - t0
    snap = clock.snapshot()
    assert (snap["bytes"], snap["reads"]) == (300, 2)
    assert 0.02 <= snap["busy_seconds"] <= wall


def test_an_expert_is_read_in_one_span_and_packed_like_segment_by_segment(tiny_ckpt) -> None:
    """The disk tier reads an expert whose tensors lie side by side in one read (a reusable
    buffer), and packs exactly the bytes the per-tensor reads gave."""
    import torch

    from engine.config import EngineConfig
    from engine.experts.tiers.slow_tier import _one_span, _pack
    from engine.worker.loader import load_model

    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.5, offload="disk"))
    try:
        tier = om.transfers.tier
        calls: list[int] = []
        read = tier.reader.read
        tier.reader.read = lambda *a, **k: calls.append(a[2]) or read(*a, **k)  # type: ignore[method-assign]
        fetched = {}
        for layer in om.moe_layers:
            for e in range(om.num_experts):
                assert (
                    _one_span(tier.locator.segments(layer, e)) is not None
                )  # save_pretrained stores an expert's tensors together
                calls.clear()
                fetched[(layer, e)] = tier._fetch(layer, e, None)
                assert len(calls) == 1
        # Checked after every fetch is done: no result may still point into the reused buffer.
        for (layer, e), got in fetched.items():
            want = _pack([tier._read(s) for s in tier.locator.segments(layer, e)])
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # Into a slot: the expert is assembled there (one copy from the read buffer), same bytes.
        layer, e = om.moe_layers[-1], om.num_experts - 1
        want = fetched[(layer, e)]
        slot = torch.full_like(want, float("nan"))
        got, nbytes = tier.fetch(layer, e, into=slot)
        assert got is slot and nbytes == tier.expert_nbytes(layer, e)
        assert torch.equal(slot.view(torch.uint8), want.view(torch.uint8))
        # A slot of another dtype (a conversion) cannot take the raw bytes: a buffer of its own comes back.
        other = torch.zeros(want.numel(), dtype=torch.float64)
        got, _ = tier.fetch(layer, e, into=other)
        assert (
            got is not other
            and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            and not other.any()
        )
    finally:
        om.close()


def test_a_sidecar_expert_is_read_into_the_reused_buffer_with_the_same_bytes(
    tiny_ckpt, tmp_path
) -> None:
    """A quantized sidecar stores an expert as one segment: it is read into the thread's reusable
    buffer (scratch), as a checkpoint's expert is, and every fetch keeps the bytes a fresh read gives."""
    import torch

    from engine.config import EngineConfig
    from engine.worker.loader import load_model

    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(
            cache_fraction=0.5,
            offload="disk",
            expert_quant="int8",
            quant_cache_dir=str(tmp_path / "quant"),
        ),
    )
    try:
        tier = om.transfers.tier
        scratch: list[bool] = []
        read = tier.reader.read
        tier.reader.read = lambda *a, **k: scratch.append(k.get("scratch", False)) or read(*a, **k)  # type: ignore[method-assign]
        fetched = {
            (layer, e): tier._fetch(layer, e, None)
            for layer in om.moe_layers
            for e in range(om.num_experts)
        }
        assert scratch and all(scratch)
        tier.reader.read = read  # type: ignore[method-assign]
        for (layer, e), got in fetched.items():
            (seg,) = tier.locator.segments(layer, e)
            assert torch.equal(got.view(torch.uint8), tier._read(seg).view(torch.uint8))
    finally:
        om.close()


def test_an_mxfp4_expert_is_read_tensor_by_tensor_into_the_reused_buffer(
    tiny_ckpt, tmp_path
) -> None:
    """gpt-oss keeps a layer's experts in one tensor per part, so an expert's six tensors lie far apart:
    each is read into the thread's reusable buffer and copied to its place, the same bytes as reading
    them one by one into fresh buffers, with or without a slot to read into."""
    import torch

    from engine.config import EngineConfig
    from engine.worker.loader import load_model
    from tests.test_native_quant import mxfp4_checkpoints

    qdir, _ = mxfp4_checkpoints(tiny_ckpt, tmp_path)
    om = load_model(qdir, EngineConfig(cache_fraction=0.5, offload="disk"))
    try:
        tier = om.transfers.tier
        scratch: list[bool] = []
        read = tier.reader.read
        tier.reader.read = lambda *a, **k: scratch.append(k.get("scratch", False)) or read(*a, **k)  # type: ignore[method-assign]
        keys = [(layer, e) for layer in om.moe_layers for e in range(om.num_experts)]
        fetched = {k: tier._fetch(*k, None) for k in keys}
        slots = {}
        for k in keys:
            n = sum(s.nbytes for s in tier.locator.segments(*k))
            slots[k] = torch.full((n,), 7, dtype=torch.uint8)
            assert tier._fetch(*k, slots[k]) is slots[k]  # straight into the slot
        assert len(scratch) == 2 * 6 * len(keys) and all(scratch)
        tier.reader.read = read  # type: ignore[method-assign]
        for k in keys:
            want = torch.cat([tier._read(s).view(torch.uint8) for s in tier.locator.segments(*k)])
            assert torch.equal(fetched[k].view(torch.uint8), want)
            assert torch.equal(slots[k], want)
    finally:
        om.close()
