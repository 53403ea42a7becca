"""Coalesced host-to-device copies (issue 40 §4): on CUDA every expert load is one copy, from pinned
memory, into its slot (engine/experts/tiers/device_copy.py). A CPU has no CUDA stream to run that code
on, so these tests run it with a recording stand-in for the CUDA calls (the real ones run in
tests/test_cuda.py on a GPU): it counts the copies and where each one read from."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from engine_helpers import settle

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.experts.tiers.device_copy import CudaOps, SlotCopier
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


class _Event:
    def record(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class RecordingOps(CudaOps):
    """CudaOps on a CPU: streams and events do nothing; 'pinned' memory is what this object pinned
    (staging rows) plus the tensors a test declares pinned (a RAM tier's chunks, pinned on a GPU)."""

    def __init__(self, pinned: list[torch.Tensor]) -> None:
        self.pinned_storage = {t.untyped_storage().data_ptr() for t in pinned}
        self.copies: list[tuple[int, bool]] = []  # (source storage, whether it was pinned)
        self.staged = 0

    def stream(self, device: torch.device) -> object:
        return object()

    def on(self, stream: object):  # type: ignore[override]  # a null context for the fake stream
        return nullcontext()

    def event(self) -> _Event:
        return _Event()

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        self.pinned_storage.add(t.untyped_storage().data_ptr())
        self.staged += 1
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.pinned_storage

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append((src.untyped_storage().data_ptr(), self.is_pinned(src)))
        dst.copy_(src)

    def order(self, device: torch.device, event: object) -> None:
        pass


def _tokens(om, n: int = 12) -> list[int]:
    prompt = torch.randint(
        3, om.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3)
    )
    return generate(om, prompt.tolist(), SamplingParams(max_tokens=n, ignore_eos=True)).tokens


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_every_expert_load_is_one_copy_from_pinned_memory(tiny_ckpt, offload: str) -> None:
    path = tiny_ckpt("qwen3_moe")
    cfg = EngineConfig(cache_fraction=0.25, offload=offload, dtype="float32", native_kernels="off")
    ref = load_model(path, cfg)
    try:
        want = _tokens(ref)
    finally:
        ref.close()
    om = load_model(path, cfg)
    try:
        tier_chunks = list(getattr(om.transfers.tier, "_chunks", []))  # pinned on a GPU
        ops = RecordingOps(tier_chunks)
        slots = om.store.slots
        om.transfers.copier = SlotCopier(ops, slots.device, slots.shape[1], slots.dtype)
        om.stats.reset()
        assert _tokens(om) == want
        settle(om)
        loads = sum(om.stats.snapshot()["transfers"].values())
        assert loads > 0
        assert len(ops.copies) == loads  # one copy per expert load
        assert all(pinned for _, pinned in ops.copies)  # each from pinned memory
        sources = {src for src, _ in ops.copies}
        if offload == "ram":  # straight from the tier's rows: no staging copy
            chunks = {c.untyped_storage().data_ptr() for c in tier_chunks}
            assert sources <= chunks
        else:  # the disk tier assembled each expert in a transfer thread's staging row
            assert 1 <= ops.staged <= om.transfers.workers and len(sources) == ops.staged
    finally:
        om.close()
