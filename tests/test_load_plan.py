"""The load plan (engine/plan/): every architecture's plan from config.json and safetensors headers alone
(no model built, no tensor made, on the meta device included), each decision with its reason; the load
builds the model the headers describe (engine/worker/built.py) to the same plan, and `moe-offload plan`
prints it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.config import EngineConfig
from engine.errors import CheckpointError, ConfigError
from engine.memory.machine import HostMemory, Machine, StatedKernels
from engine.native.loaded import probe
from engine.plan.load_plan import LoadPlan
from engine.plan.resolve import machine_ahead, resolve
from engine.plan.survey import survey, survey_footprint
from engine.weights.forward_support import MOE_LEAN_MODEL_TYPES
from engine.worker.built import build_meta, model_layout
from engine.worker.loader import load_model
from models.tiny import ARCHS, NEW_ARCHS, STRUCTURAL_ARCHS, write_tiny_headers

MiB, GiB = 1 << 20, 1 << 30
ALL_ARCHS = ARCHS + NEW_ARCHS + STRUCTURAL_ARCHS
ROOMY = Machine(HostMemory(8 * GiB, "stated", None, None))
TOP_K = {"llama4_text": 1}  # the tiny configs' experts a token (models/tiny.py); 2 elsewhere


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    """Factory: headers(arch, dtype) -> a checkpoint of config.json and data-less safetensors headers."""
    made: dict[tuple, Path] = {}

    def get(arch: str, dtype: torch.dtype = torch.float32) -> Path:
        if (arch, dtype) not in made:
            made[arch, dtype] = write_tiny_headers(tmp_path_factory.mktemp(arch), arch, dtype)
        return made[arch, dtype]

    return get


class _Tensors(TorchDispatchMode):
    """Every op whose output is a tensor, on the meta device included."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            self.made.append(f"{func} on {[t.device.type for t in tree_leaves(out)][0]}")
        return out


def _reasons(plan: LoadPlan) -> list[str]:
    return [
        plan.arch.why,
        plan.experts.why,
        plan.kernels.line,
        *(p.why for p in plan.memory.pools),
        *(c.why for c in plan.execution.choices),
    ]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_every_architecture_plans_from_headers_without_a_tensor(headers, arch: str) -> None:
    cfg = EngineConfig(device="cpu", dtype="float32", native_kernels="off")
    path = headers(arch)  # written from a model on the meta device: before the count starts
    with _Tensors() as made:
        plan = resolve(path, cfg, ROOMY)
    assert made.made == [], f"resolve made tensors: {made.made[:5]}"
    ex, mem = plan.experts, plan.memory
    assert (plan.arch.model_type, plan.device, plan.dtype) == (arch, "cpu", "float32")
    assert plan.arch.by_structure == (arch in STRUCTURAL_ARCHS)
    assert (ex.format, ex.slot_dtype, ex.num_experts, ex.top_k) == (
        "none",
        "float32",
        8,
        TOP_K.get(arch, 2),
    )
    assert ex.hidden == 64 and ex.slot_bytes >= 3 * 64 * ex.intermediate * 4
    assert (
        ex.disk_bytes >= ex.slot_bytes
    )  # float32 experts on disk: the bytes a slot holds (and biases)
    # 8 GiB hold everything: every expert in the RAM tier, which is the fast tier itself.
    assert mem.offload == "ram" and mem.n_slots == mem.total_experts == ex.total and plan.complete
    pools = mem.planned()
    assert pools["fast_tier"] == 0 and pools["slow_tier"] == ex.total * ex.slot_bytes
    assert pools["dense"] > 0 and pools["kv_cache"] > 0 and "runtime" not in pools
    assert mem.total("host", budgeted=True) <= mem.host_budget == 8 * GiB
    assert (
        plan.kv_token_budget == 512 * 4
    )  # min(context 512, 8192) tokens x 4 sequences, the defaults
    # The native kernels off: the lean forward where the architecture has one, else transformers'.
    forward = "lean" if arch in MOE_LEAN_MODEL_TYPES else "transformers"
    steps = plan.execution.to_dict()
    assert plan.execution.forward == forward and steps["forward"]["chosen"] == forward
    assert (
        steps["experts"]["chosen"] == "resident lane"
        and steps["expert kernel"]["chosen"] == "torch"
    )
    assert steps["native kernels"]["chosen"] == "off" and plan.kernels.build is None
    assert plan.prefetch == () and steps["prefetch"]["chosen"] == "none"
    assert all(why.strip() for why in _reasons(plan))
    text = plan.describe()
    assert text.splitlines()[0].startswith(f"load plan for {headers(arch)}: {arch}, ")
    assert "memory plan (" in text and "execution plan:" in text and "  expert kernel" in text


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_the_model_a_load_builds_is_the_one_its_headers_describe(headers, arch: str) -> None:
    """What a plan is sized from (engine/weights/header_survey.py: MoE layers, experts' geometry,
    dense parameters and linears, input embedding, the lean forward's structure) is what the load's
    model, built by transformers on the meta device, holds: the plan the headers give is the plan
    the built model would give. Checkpoints in f32 and bf16; --dense-quant int8 counts the linears."""
    for dtype in (torch.float32, torch.bfloat16):
        for dense_quant in ("none", "int8"):
            cfg = EngineConfig(device="cpu", dtype="float32", dense_quant=dense_quant)
            sv = survey(headers(arch, dtype), cfg, "cpu")
            built = build_meta(sv)  # check_built: raises where any fact differs
            assert model_layout(built).dense_params == sv.layout.dense_params > 0
            assert [s.layer for s in built.sites] == list(sv.layout.moe_layers)
            geometry = (built.experts.num_experts, built.experts.shape, built.experts.top_k)
            assert geometry == (sv.experts.num_experts, sv.experts.shape, sv.experts.top_k)
            assert built.experts.kernel.views == sv.experts.kernel.views


# Every checkpoint's survey and plan as text, resolved in the test and in a child where torch cannot be imported.
_PLANS = """
from engine.config import EngineConfig
from engine.memory.machine import HostMemory, Machine, StatedKernels
from engine.plan.resolve import resolve
from engine.plan.survey import survey


def plans(paths):
    host = HostMemory(8 << 30, "stated", None, None)
    machine = Machine(host, quant_disk_free=1 << 30, ahead=True, kernels=StatedKernels("avx2", "on: stated"))
    out = {}
    for name, path in paths.items():
        for kernels, quant in (("off", "none"), ("auto", "none"), ("off", "int8")):
            cfg = EngineConfig(device="cpu", dtype="float32", native_kernels=kernels, expert_quant=quant)
            sv, plan = survey(path, cfg, "cpu"), resolve(path, cfg, machine)
            ck, ex = sv.ck, sv.experts
            facts = [ck.device, ck.dtype, sorted(map(repr, ck.tensors.values())), repr(sv.layout)]
            facts += [ex.moe_layers, ex.num_experts, repr(ex.shape), ex.kernel.views, ex.top_k]
            out[f"{name} {kernels} {quant}"] = [repr(plan), plan.describe(), repr(facts), repr(sv.embedding)]
    return out
"""
_WITHOUT_TORCH = (
    """
import json, sys
sys.modules["torch"] = None  # `import torch` fails from here on
"""
    + _PLANS
    + """
print(json.dumps(plans(json.loads(sys.argv[1]))))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch")))
"""
)


def test_the_load_plan_resolves_where_torch_cannot_be_imported(headers) -> None:
    """resolve and survey need config.json and the headers only: in a process where `import torch` fails,
    every architecture's checkpoint, in f32 and bf16, with the native kernels off, stated on, and int8
    experts planned ahead, gives the plan (and the survey) this process gives, to the character."""
    paths = {
        f"{arch} {str(dtype)[6:]}": str(headers(arch, dtype))
        for arch in ALL_ARCHS
        for dtype in (torch.float32, torch.bfloat16)
    }
    here: dict = {}
    exec(_PLANS, here)
    want = here["plans"](paths)
    assert any("bf16 slots" in plan for plan, *_ in want.values())  # the stated kernels ran
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, json.dumps(paths)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got, loaded = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert loaded == ["torch"]  # the blocked name alone: no torch module was loaded
    assert got == want


def test_a_model_unlike_its_headers_fails_the_load_in_one_line(headers) -> None:
    sv = survey(headers("qwen3_moe"), EngineConfig(device="cpu", dtype="float32"), "cpu")
    for wrong in (
        dict(dense_params=sv.layout.dense_params + 1),
        dict(moe_layers=(1,)),
        dict(lean=False),
        dict(dense_linears=sv.layout.dense_linears[1:]),
    ):
        with pytest.raises(
            CheckpointError, match=r"is not the one its safetensors headers describe"
        ):
            build_meta(replace(sv, layout=replace(sv.layout, **wrong)))


def test_the_plan_follows_the_budget_and_fails_in_one_line(headers) -> None:
    path = headers("qwen3_moe")
    cfg = EngineConfig(device="cpu", dtype="float32", native_kernels="off")
    roomy = resolve(path, cfg, ROOMY).memory.planned()
    fixed = sum(roomy[p] for p in ("dense", "kv_cache", "scratch")) + 64 * MiB  # headroom's floor
    slot = resolve(path, cfg, ROOMY).experts.slot_bytes
    tight = resolve(path, cfg, Machine(HostMemory(fixed + 5 * slot, "stated", None, None)))
    assert (tight.memory.offload, tight.memory.n_slots) == ("disk", 5) and not tight.complete
    assert tight.execution.to_dict()["experts"]["chosen"] == "streaming"
    with pytest.raises(ConfigError, match=r"^memory plan: .*short by "):
        resolve(path, cfg, Machine(HostMemory(10 * MiB, "stated", None, None)))


def test_slot_formats_and_their_reasons(headers) -> None:
    """bf16 slots of an f32 model where every expert is bf16 and the native kernels run; int8 slots
    read from a sidecar (planned ahead of the load as a file still to write); the compute dtype else."""
    bf16 = headers("qwen3_moe", torch.bfloat16)
    probed = replace(ROOMY, kernels=probe)  # this CPU's kernels, built and measured here
    plan = resolve(bf16, EngineConfig(device="cpu", dtype="float32"), probed)
    if plan.kernels.build is not None:  # a compiler here: the native kernels run
        assert plan.experts.slot_dtype == "bfloat16" and "bf16 slots" in plan.experts.why
        assert plan.kernels.line.startswith("on: ") and "measured" in plan.kernels.line
    else:
        assert plan.experts.slot_dtype == "float32"
    cfg = EngineConfig(device="cpu", dtype="float32", expert_quant="int8", native_kernels="off")
    ahead = Machine(ROOMY.host, quant_disk_free=GiB, ahead=True)
    quant = resolve(headers("qwen3_moe"), cfg, ahead)
    ex = quant.experts
    assert (ex.format, ex.slot_dtype, ex.disk_bytes) == ("int8", "uint8", ex.slot_bytes)
    assert "--expert-quant int8" in ex.why
    assert quant.memory.planned()["quant_sidecar"] == ex.total * ex.slot_bytes
    assert "quant_sidecar" not in resolve(headers("qwen3_moe"), cfg, ROOMY).memory.planned()


def test_the_plan_reads_the_kernels_the_machine_states(headers) -> None:
    """The native kernels are a fact of the machine (`Machine.kernels`), probed before resolve: a
    stated build decides the slots' dtype and the expert kernel with no kernels loaded; off stays off."""
    stated = replace(ROOMY, kernels=StatedKernels("avx2", "on: stated"))
    bf16 = headers("qwen3_moe", torch.bfloat16)
    plan = resolve(bf16, EngineConfig(device="cpu", dtype="float32"), stated)
    assert (plan.kernels.build, plan.kernels.line) == ("avx2", "on: stated")
    assert plan.experts.slot_dtype == "bfloat16"
    steps = plan.execution.to_dict()
    assert steps["expert kernel"]["chosen"] == "native SwiGLU, one call a layer (bfloat16 weights)"
    off = resolve(bf16, EngineConfig(device="cpu", dtype="float32", native_kernels="off"), stated)
    assert off.kernels.build is None and off.experts.slot_dtype == "float32"


def test_narrowed_dense_bytes_follow_the_plans_kernels(headers) -> None:
    """An f32 model from a bf16 checkpoint reads its dense weights as bf16 only where the native kernels
    run: the plan counts those bytes saved by its own kernel answer, not by whichever build this process
    could load (which planned a narrowing that a load with --native-kernels off never makes)."""
    stated = replace(ROOMY, kernels=StatedKernels("avx2", "on: stated"))
    bf16 = headers("qwen3_moe", torch.bfloat16)
    on = resolve(bf16, EngineConfig(device="cpu", dtype="float32"), stated)
    off = resolve(bf16, EngineConfig(device="cpu", dtype="float32", native_kernels="off"), stated)
    dense_on, dense_off = on.memory.planned()["dense"], off.memory.planned()["dense"]
    assert dense_on < dense_off  # the narrowed linears hold half their f32 bytes
    sv = survey(bf16, EngineConfig(device="cpu", dtype="float32"), "cpu")
    saved = survey_footprint(sv, EngineConfig(device="cpu", dtype="float32"), 1, 1, True)
    assert saved.dense_saved_bytes == dense_off - dense_on


def test_the_load_builds_the_plan_and_plan_prints_it(tiny_ckpt, capsys) -> None:
    """`moe-offload plan` prints the plan resolve makes; a load builds to the same plan (less the
    process's measured runtime, which only a load lists) and its start-up line is that plan's text."""
    from cli.main import main

    path = tiny_ckpt("qwen3_moe")
    cfg = EngineConfig(device="cpu", dtype="float32", host_memory="8GiB", cache_fraction=0.5)
    resolve(path, cfg, machine_ahead(cfg))  # the kernels' measurement, cached for the rest
    argv = ["plan", "--model", str(path), "--device", "cpu", "--dtype", "float32"]
    capsys.readouterr()
    assert main([*argv, "--host-memory", "8GiB", "--cache-fraction", "0.5"]) == 0
    printed = capsys.readouterr().out
    ahead = resolve(path, cfg, machine_ahead(cfg))
    assert ahead.describe() in printed
    om = load_model(path, cfg)
    try:
        built: LoadPlan = om.load_plan
        assert om.plan is built.execution and om.memory_plan is built.memory
        assert built.memory.pools[0].name == "runtime"
        assert built.memory.pools[1:] == ahead.memory.pools
        assert (built.experts, built.kernels, built.arch) == (
            ahead.experts,
            ahead.kernels,
            ahead.arch,
        )
        assert built.execution == ahead.execution and built.kv_token_budget == ahead.kv_token_budget
        assert om.store.n_slots == built.memory.n_slots == 8
        started = built.with_speculation("off", "--speculative off").lines()
        assert started[: len(built.lines())] == built.lines() and "speculation" in started[-1]
    finally:
        om.close()
