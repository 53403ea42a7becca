"""The memory planner (engine/memory/): machine readings, budgets, placement, and its use at load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.budget import parse_budget, resolve_budget
from engine.config import EngineConfig
from engine.core.completion import generate
from engine.errors import ConfigError
from engine.experts.tiers.slow_tier import DiskTier, RamTier
from engine.memory.footprint import Footprint
from engine.memory.machine import HostMemory, cgroup_headroom, host_memory
from engine.memory.planner import KvRequest, plan_memory
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams
from models.tiny import load_reference

GiB, MiB = 1 << 30, 1 << 20


def _fp(slot: int = 4 * MiB, layers: int = 4, experts: int = 16) -> Footprint:
    return Footprint(
        dtype="bfloat16",
        dense_bytes=100 * MiB,
        slot_bytes=slot,
        expert_disk_bytes=slot,
        moe_layers=layers,
        experts_per_layer=experts,
        top_k=2,
        kv_bytes_per_token=4096,
        sliding_kv_bytes_per_token=0,
        sliding_window=0,
        context=2048,
        hidden=256,
        intermediate=512,
        vocab=1000,
        checkpoint_bytes=400 * MiB,
    )


def _host(n: int) -> HostMemory:
    return HostMemory(n, "MemAvailable", n, None)


def test_budgets_parse_bytes_and_fractions() -> None:
    assert parse_budget("24GiB", "--x") == (24 * GiB, None)
    assert parse_budget("512MiB", "--x") == (512 * MiB, None)
    assert parse_budget("2G", "--x") == (2 * 10**9, None)
    assert parse_budget("0.8", "--x") == (None, 0.8)
    assert parse_budget("80%", "--x") == (None, 0.8)
    assert parse_budget("1234", "--x") == (1234, None)
    assert resolve_budget("50%", "--x", 1000) == 500 and resolve_budget(None, "--x", 1000) == 1000
    for bad in ("lots", "-3", "0.0", "150%"):
        with pytest.raises(ConfigError, match="--x"):
            parse_budget(bad, "--x")
    with pytest.raises(ConfigError, match="--host-memory"):
        EngineConfig(host_memory="plenty")


def _write(d: Path, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)


def test_cgroup_v1_and_v2_limits_are_read(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100000000 kB\nMemAvailable: 8000000 kB\n")
    # v1: the limit less the working set (usage without the inactive page cache); the tightest ancestor wins.
    root1 = tmp_path / "v1"
    _write(
        root1 / "memory" / "a" / "b",
        {
            "memory.limit_in_bytes": str(3 * GiB),
            "memory.usage_in_bytes": str(2 * GiB),
            "memory.stat": f"cache 1\ntotal_inactive_file {GiB // 2}\n",
        },
    )
    _write(
        root1 / "memory" / "a",
        {
            "memory.limit_in_bytes": str(9 * GiB),
            "memory.usage_in_bytes": str(2 * GiB),
            "memory.stat": "",
        },
    )
    _write(root1 / "memory", {"memory.limit_in_bytes": str(1 << 62), "memory.usage_in_bytes": "0"})
    cg1 = tmp_path / "cgroup1"
    cg1.write_text("9:name=systemd:/\n4:memory:/a/b\n0::/\n")
    assert cgroup_headroom(cg1, root1) == (
        3 * GiB - (2 * GiB - GiB // 2),
        f"cgroup v1 limit {3 * GiB} B",
    )
    hm = host_memory(meminfo, cg1, root1)
    assert (
        hm.available == int(1.5 * GiB)
        and hm.source.startswith("cgroup v1")
        and hm.mem_available == 8000000 * 1024
    )
    # v2: memory.max / memory.current / inactive_file; "max" is no limit.
    root2 = tmp_path / "v2"
    _write(root2, {"cgroup.controllers": "memory"})
    _write(
        root2 / "svc",
        {
            "memory.max": str(GiB),
            "memory.current": str(GiB // 4),
            "memory.stat": "inactive_file 0\n",
        },
    )
    cg2 = tmp_path / "cgroup2"
    cg2.write_text("0::/svc\n")
    assert cgroup_headroom(cg2, root2)[0] == GiB - GiB // 4
    (root2 / "svc" / "memory.max").write_text("max\n")
    assert cgroup_headroom(cg2, root2) is None
    assert host_memory(meminfo, cg2, root2).source == "MemAvailable"


def test_cpu_plan_keeps_experts_in_ram_when_they_fit_else_reads_disk() -> None:
    fp = _fp()  # 64 experts x 4 MiB = 256 MiB of experts
    big = plan_memory(fp, EngineConfig(), "cpu", _host(8 * GiB))
    assert (big.offload, big.n_slots, big.zero_copy) == ("ram", 64, True)
    assert big.planned()["fast_tier"] == 0 and big.planned()["slow_tier"] == 64 * 4 * MiB
    small = plan_memory(fp, EngineConfig(kv_tokens=0), "cpu", _host(400 * MiB))
    left = 400 * MiB - (fp.dense_bytes + fp.scratch_bytes() + 64 * MiB)
    assert small.offload == "disk" and small.n_slots == left // (4 * MiB) < 64
    assert small.total("host", budgeted=True) <= 400 * MiB
    assert "slow_tier" in small.table() and "disk" in small.table()
    # Explicit flags win over the plan's choice.
    forced = plan_memory(
        fp, EngineConfig(offload="disk", cache_fraction=0.25), "cpu", _host(8 * GiB)
    )
    assert (forced.offload, forced.n_slots) == ("disk", 16)


def test_a_combination_that_cannot_fit_fails_with_one_line() -> None:
    fp = _fp()
    with pytest.raises(ConfigError) as e:
        plan_memory(fp, EngineConfig(offload="ram", kv_tokens=0), "cpu", _host(400 * MiB))
    msg = str(e.value)
    assert (
        "\n" not in msg
        and "every expert in RAM" in msg
        and "short by" in msg
        and "--offload disk" in msg
    )
    with pytest.raises(ConfigError, match="short by"):
        plan_memory(
            fp,
            EngineConfig(cache_fraction=1.0, offload="disk", kv_tokens=0),
            "cpu",
            _host(300 * MiB),
        )
    with pytest.raises(ConfigError, match="dense part"):
        plan_memory(fp, EngineConfig(), "cpu", _host(50 * MiB))


def test_kv_reservation_is_per_token_x_max_model_len_x_max_running() -> None:
    fp = _fp()  # 4096 B of KV per token, context 2048
    host = _host(400 * MiB)  # every expert does not fit: the fast tier gets what is left

    def plan(req: KvRequest, **cfg: object):
        p = plan_memory(fp, EngineConfig(**cfg), "cpu", host, kv_request=req)  # type: ignore[arg-type]
        kv = next(x for x in p.pools if x.name == "kv_cache")
        fixed = ("dense", "kv_cache", "scratch", "headroom")
        left = 400 * MiB - sum(x.nbytes for x in p.pools if x.name in fixed)
        # The fast tier is what the KV line (and the other fixed rows) leave.
        assert p.offload == "disk" and p.n_slots == left // fp.slot_bytes
        return p, kv

    # Open: the stated default, min(context, 8192) tokens x 4 sequences.
    p0, kv0 = plan(KvRequest())
    assert kv0.nbytes == 4096 * 2048 * 4
    assert (
        "x 2048 tokens (--max-model-len open: min(context 2048, 8192)) x 4 sequences (--max-running open"
        in kv0.why
    )
    # Given: exactly KV per token x --max-model-len x --max-running, and the fast tier takes the rest.
    p1, kv1 = plan(KvRequest(max_model_len=512, max_running=2))
    assert kv1.nbytes == 4096 * 512 * 2
    assert (
        "4.0 KiB/token x 512 tokens (--max-model-len 512) x 2 sequences (--max-running)" in kv1.why
    )
    assert p1.n_slots - p0.n_slots == (kv0.nbytes - kv1.nbytes) // fp.slot_bytes > 0
    p2, kv2 = plan(KvRequest(max_model_len=1024, max_running=12))
    assert kv2.nbytes == 4096 * 1024 * 12 and p2.n_slots < p0.n_slots
    assert "kv_cache" in p2.table() and "x 12 sequences (--max-running)" in p2.table()
    # --max-model-len beyond the model's context is capped at it, and says so.
    _, kv3 = plan(KvRequest(max_model_len=100_000, max_running=1))
    assert kv3.nbytes == 4096 * 2048 and "capped at the context 2048" in kv3.why
    # --kv-tokens, a total, still wins.
    _, kv4 = plan(KvRequest(max_model_len=1024, max_running=6), kv_tokens=300)
    assert kv4.nbytes == 4096 * 300 and "(--kv-tokens)" in kv4.why
    # A reservation that cannot fit names the flags that shrink it.
    with pytest.raises(ConfigError, match="short by.*--max-model-len / --max-running"):
        plan_memory(fp, EngineConfig(), "cpu", host, kv_request=KvRequest(2048, 64))


def test_sliding_layers_reserve_at_most_the_window_per_sequence() -> None:
    fp = dataclasses.replace(_fp(), sliding_kv_bytes_per_token=1000, sliding_window=128)
    p = plan_memory(fp, EngineConfig(), "cpu", _host(8 * GiB), kv_request=KvRequest(1024, 3))
    kv = next(x for x in p.pools if x.name == "kv_cache")
    assert kv.nbytes == 3 * (1024 * 4096 + 128 * 1000) and "128-token window" in kv.why


def test_gpu_plan_sizes_the_fast_tier_to_device_memory() -> None:
    fp = _fp()
    cfg = EngineConfig(device_memory="1GiB", kv_tokens=1000)
    plan = plan_memory(fp, cfg, "cuda:0", _host(64 * GiB), device_free=80 * GiB)
    fixed = fp.dense_bytes + 1000 * 4096 + fp.scratch_bytes() + 256 * MiB
    assert plan.n_slots == min(64, (GiB - fixed) // (4 * MiB)) and plan.offload == "ram"
    assert plan.total("device") <= GiB
    # Not enough host RAM for every expert: the slow tier is the disk.
    assert plan_memory(fp, cfg, "cuda:0", _host(200 * MiB), device_free=80 * GiB).offload == "disk"
    half = plan_memory(
        fp, EngineConfig(device_memory="0.5"), "cuda:0", _host(64 * GiB), device_free=2 * GiB
    )
    assert half.device_budget == GiB


def test_load_follows_the_plan_and_stays_exact(tiny_ckpt) -> None:
    path = tiny_ckpt("qwen3_moe")
    ref = load_reference(path)
    with torch.no_grad():
        want = ref.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)[
            0, 3:
        ].tolist()
    # Budget for the dense part, the scratch and the headroom, plus 5 experts: the plan reads the rest from disk.
    probe = load_model(path, EngineConfig(device="cpu", dtype="float32", kv_tokens=0))
    slot, fixed = (
        probe.memory_plan.slot_bytes,
        sum(p.nbytes for p in probe.memory_plan.pools if p.name in ("dense", "scratch")) + 64 * MiB,
    )
    probe.close()
    om = load_model(
        path,
        EngineConfig(device="cpu", dtype="float32", kv_tokens=0, host_memory=str(fixed + 5 * slot)),
    )
    try:
        assert (
            om.memory_plan.offload == "disk"
            and isinstance(om.transfers.tier, DiskTier)
            and om.store.n_slots == 5
        )
        out = generate(om, [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
        assert out.token_ids == want
        mem = om.stats.snapshot()["memory"]
        assert mem["fast_tier"] == {"planned": 5 * slot, "used": 5 * slot}
        assert mem["host_total"]["used"] > 0
    finally:
        om.close()


def test_metrics_export_planned_and_used_bytes(tiny_ckpt) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from server.metrics import EngineStatsCollector

    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu"))
    try:
        c = EngineStatsCollector()
        c.snapshot = om.stats.snapshot()
        reg = CollectorRegistry()
        reg.register(c)
        text = generate_latest(reg).decode()
        dense = om.memory_plan.planned()["dense"]
        assert f'moe_offload_memory_planned_bytes{{pool="dense"}} {float(dense)}' in text
        assert 'moe_offload_memory_used_bytes{pool="host_total"}' in text
    finally:
        om.close()


def test_serve_refuses_a_plan_that_cannot_fit_before_listening(tiny_ckpt, capsys) -> None:
    from cli.main import main

    rc = main(
        ["serve", "--model", str(tiny_ckpt("qwen3_moe")), "--host-memory", "10MiB", "--port", "1"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2 and err[-1].startswith("moe-offload: error: memory plan:") and "short by" in err[-1]
    )


def test_ram_tier_pins_in_chunks_and_falls_back_to_pageable(tiny_ckpt, caplog) -> None:
    """On this CPU-only build pinning is refused: the tier must come up pageable, say so once, and
    serve the same rows as the disk tier, chunked or not."""
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", cache_fraction=0.5, offload="disk")
    )
    try:
        locator, layers = om.transfers.tier.locator, om.moe_layers
        disk = om.transfers.tier
        row = om.executor.fmt.slot_bytes
        with caplog.at_level("WARNING", logger="engine.experts.slow_tier"):
            tier = RamTier(
                locator,
                layers,
                getattr(torch, om.executor.fmt.slot_dtype),
                pin=True,
                chunk_bytes=3 * row,
                pin_limit=None if not torch.cuda.is_available() else 0,
            )
        warnings = [r for r in caplog.records if "pinning failed" in r.getMessage()]
        assert (
            len(warnings) == 1
            and tier.pageable_bytes == tier.nbytes == len(layers) * om.num_experts * row
        )
        assert len(tier._chunks) == -(-len(layers) * om.num_experts // 3)
        for layer in layers:
            for e in range(om.num_experts):
                assert torch.equal(tier.fetch(layer, e)[0], disk.fetch(layer, e)[0])
    finally:
        om.close()
