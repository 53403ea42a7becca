"""`plan --hardware measured`: the cost model built from this CPU's kernel and disk figures.

No timing here: each test forces the figures (a slow or fast kernel, a slow or fast disk) and checks
that the costs, and the projection the plan prints from them, move as they must."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cli.plan import DEFAULT_TRACE, project
from engine.memory.footprint import Footprint
from engine.offline.machine_costs import KernelSpeeds, machine_costs, read_gb_s

H, I, K, E, LAYERS = (
    2048,
    768,
    8,
    128,
    2,
)  # Qwen3-30B-A3B's layer shape: the embedded trace projects onto it
SLOT = 3 * H * I * 2
DENSE = 40_000_000 * LAYERS * 2


def footprint() -> Footprint:
    return Footprint(
        dtype="bfloat16",
        dense_bytes=DENSE,
        slot_bytes=SLOT,
        expert_disk_bytes=SLOT,
        moe_layers=LAYERS,
        experts_per_layer=E,
        top_k=K,
        kv_bytes_per_token=4096,
        sliding_kv_bytes_per_token=0,
        sliding_window=0,
        context=4096,
        hidden=H,
        intermediate=K * I,
        vocab=151_936,
        checkpoint_bytes=DENSE + LAYERS * E * SLOT,
    )


def costs(dense_gb_s=10.0, expert_gb_s=10.0, disk_gb_s=1.0, overhead_s=0.0, share=1.0):
    speeds = KernelSpeeds("avx512", dense_gb_s, overhead_s, expert_gb_s, True)
    return machine_costs(speeds, disk_gb_s, 16, DENSE, LAYERS, SLOT, SLOT, 2, 2, share)


def projected(c, cache_fraction: float) -> float:
    rows, how = project(
        footprint(), "qwen3_moe", cache_fraction, "measured", None, DEFAULT_TRACE, lambda: c
    )
    assert rows, how
    assert "profile measured" in how
    return dict(rows)["fetch-all"]


def test_the_costs_are_the_bytes_over_the_measured_rates() -> None:
    c = costs(dense_gb_s=8.0, expert_gb_s=4.0, disk_gb_s=0.5, overhead_s=1e-4)
    assert c.d(1) == pytest.approx(DENSE / LAYERS / 8e9 + 1e-4)
    assert c.g(1) == c.h(1) == pytest.approx(SLOT / 4e9)
    assert c.copy_seconds() == pytest.approx(SLOT / 0.5e9)
    assert c.cpu_is_fast_device and c.cpu_reads_over_link
    assert any("0.50 GB/s" in n for n in c.notes) and any("4.0 GB/s" in n for n in c.notes)


def test_a_slower_kernel_or_disk_projects_a_slower_decode() -> None:
    base = projected(costs(), 0.25)
    assert projected(costs(expert_gb_s=2.5), 0.25) < base  # experts 4x slower
    assert projected(costs(dense_gb_s=2.5), 0.25) < base  # dense 4x slower
    assert projected(costs(disk_gb_s=0.25), 0.25) < base  # disk 4x slower: misses cost more
    assert projected(costs(expert_gb_s=40.0, dense_gb_s=40.0), 0.25) > base
    assert projected(costs(), 0.25) == base  # the same figures, the same projection
    assert projected(costs(share=0.5), 0.25) < base  # half a core: compute takes twice as long


def test_a_shared_core_stretches_the_compute_not_the_disk() -> None:
    c, half = costs(), costs(share=0.5)
    assert half.d(1) == pytest.approx(2 * c.d(1)) and half.g(1) == pytest.approx(2 * c.g(1))
    assert half.copy_seconds() == c.copy_seconds()
    assert any("50% of a core" in n for n in half.notes)


def test_with_every_expert_resident_the_disk_does_not_matter() -> None:
    full = projected(costs(), 1.0)
    assert projected(costs(disk_gb_s=0.01), 1.0) == pytest.approx(full)
    # All resident, one row a step: a token is the dense part and top-k experts per layer.
    c = costs()
    assert full == pytest.approx(1 / (LAYERS * (c.d(1) + K * c.g(1))), rel=0.02)


def test_a_cuda_plan_names_a_profile_instead(tiny_ckpt) -> None:
    from cli.plan import measured_costs
    from engine.config import EngineConfig
    from engine.offline.hardware import ProfileError
    from engine.plan.probe import probe_checkpoint

    probe = probe_checkpoint(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu"))
    with pytest.raises(ProfileError, match="CUDA"):
        measured_costs(replace(probe, device=torch.device("cuda")), EngineConfig())


def test_the_probe_lists_expert_reads_the_disk_tier_makes(tiny_ckpt) -> None:
    from engine.config import EngineConfig
    from engine.plan.probe import probe_checkpoint

    model = tiny_ckpt("qwen3_moe")
    probe = probe_checkpoint(model, EngineConfig(device="cpu"))
    fp = probe.footprint
    assert probe.expert_reads and all(r.nbytes == fp.expert_disk_bytes for r in probe.expert_reads)
    assert len({(r.path, r.offset) for r in probe.expert_reads}) == len(probe.expert_reads)
    gb_s, n = read_gb_s(probe.expert_reads, budget=0)
    assert gb_s > 0 and n == min(32, len(probe.expert_reads))
    assert 0 < probe.dense_streamed_bytes <= fp.dense_bytes


def test_read_rate_counts_every_byte(tmp_path: Path) -> None:
    from engine.plan.probe import ExpertRead

    f = tmp_path / "blob"
    f.write_bytes(bytes(range(256)) * 4096 * 12)
    reads = [ExpertRead(f, i * 65536 + 17, 65536) for i in range(40)]
    _, n = read_gb_s(reads, budget=5 * 65536)
    assert n == 32  # at least DISK_READS_MIN, then stops at the budget


def test_an_mxfp4_expert_is_read_as_its_tensors_and_timed_on_its_kernel(
    tiny_ckpt, tmp_path
) -> None:
    """gpt-oss keeps a layer's experts in one tensor per part, so an expert is six byte ranges far
    apart: the probe lists those ranges (not the bytes between them), and the plan's expert cost is
    the MXFP4 kernel's, not moe_swiglu's."""
    from engine.config import EngineConfig
    from engine.native.loaded import native
    from engine.offline.machine_costs import kernel_speeds
    from engine.plan.probe import probe_checkpoint
    from tests.test_native_quant import mxfp4_checkpoints

    qdir, _ = mxfp4_checkpoints(tiny_ckpt, tmp_path)
    probe = probe_checkpoint(qdir, EngineConfig(device="cpu"))
    fp = probe.footprint
    assert probe.expert_format == "mxfp4"
    for r in probe.expert_reads:
        assert len(r.parts) == 6 and r.nbytes == sum(n for _, n in r.parts) == fp.expert_disk_bytes
        assert (
            r.nbytes < fp.experts_bytes / fp.moe_layers / 2
        )  # not a span over the layer's experts
    gb_s, n = read_gb_s(probe.expert_reads, budget=0)
    assert gb_s > 0 and n == min(32, len(probe.expert_reads))
    if native() is None:
        return  # no C compiler: the plan names a profile instead (test above)
    speeds = kernel_speeds(
        probe.config, fp.dtype, "none", fp.hidden, probe.moe_intermediate, fp.top_k, "mxfp4"
    )
    assert speeds is not None and speeds.expert_kernel == "moe_mxfp4" and speeds.expert_gb_s > 0


def test_int8_experts_are_timed_on_the_int8_kernel(tiny_ckpt) -> None:
    """With --expert-quant int8 the probe names the experts' format "int8": the plan still finds the
    native kernel's measurement for it (it once answered "no native kernel measurement")."""
    from engine.config import EngineConfig
    from engine.native.loaded import native
    from engine.offline.machine_costs import kernel_speeds
    from engine.plan.probe import probe_checkpoint

    probe = probe_checkpoint(
        tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", expert_quant="int8")
    )
    fp = probe.footprint
    assert probe.expert_format == "int8"
    if native() is None:
        return  # no C compiler: the plan names a profile instead (test above)
    speeds = kernel_speeds(
        probe.config, fp.dtype, "int8", fp.hidden, probe.moe_intermediate, fp.top_k, "int8"
    )
    assert speeds is not None and speeds.expert_kernel == "moe_swiglu" and speeds.expert_gb_s > 0
    assert (
        kernel_speeds(
            probe.config, fp.dtype, "int8", fp.hidden, probe.moe_intermediate, fp.top_k, "int4"
        )
        is None
    )


def test_read_rate_reads_every_part(tmp_path: Path) -> None:
    from engine.plan.probe import ExpertRead

    f = tmp_path / "blob"
    f.write_bytes(bytes(range(256)) * 4096 * 12)
    parts = ((4096, 8192), (1 << 20, 100), (2 << 20, 5000))
    reads = [ExpertRead(f, 4096, sum(n for _, n in parts), parts)] * 3
    _, n = read_gb_s(reads, budget=0)
    assert n == 3
    from engine.errors import CheckpointError

    with pytest.raises(
        CheckpointError, match="truncated"
    ):  # a part past the end is read, not skipped
        read_gb_s([ExpertRead(f, 0, 10, ((len(f.read_bytes()) + 4096, 10),))], budget=0)
