"""Host reads per decode step in the resident path (issue 40 §4): on a GPU each read of a tensor's
values to the host (item, tolist, int, bool, ...) is a synchronization. A CPU cannot show them in a
profile, so engine/worker/host_reads.py counts them through torch's function hooks, on the path a
GPU decode takes (the lean forward with torch's kernels; the native CPU kernels are off there) and
with the device lane a CUDA executor uses (engine/experts/compute/device_lane.py), forced on here.

The bound: one read per decode step, the sampled token (greedy_token), and none in any MoE layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.experts.compute.device_lane import DeviceLane
from engine.worker.host_reads import HostReads
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams

# A GPU keeps the input embedding in its memory: the CPU's table on disk (engine/weights/disk_embedding.py),
# whose row reads need the token ids on the host, is not on that path.
GPU_PATH = dict(
    cache_fraction=1.0,
    dtype="float32",
    native_kernels="off",
    forward="lean",
    embedding_on_disk=False,
)


def _reads_per_step(om, prompt: list[int], steps: int) -> tuple[float, Counter[str]]:
    """Host reads of one generate call of `steps` decode steps, less those of a call with none
    (the prefill and the request's setup): the reads of the decode steps alone, per step, and the
    source lines that made them."""
    params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
    generate(om, prompt, params(steps + 1))  # warm-up: tables and caches made once
    with HostReads() as base:
        generate(om, prompt, params(1))
    with HostReads() as reads:
        generate(om, prompt, params(steps + 1))
    return (reads.total - base.total) / steps, reads.by_line - base.by_line


@pytest.fixture
def gpu_path_model(tiny_ckpt):
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(**GPU_PATH))
    yield om
    om.close()


def _force_device_lane(om) -> DeviceLane:
    ex = om.executor
    assert DeviceLane.supports(ex.fmt) and ex.store.complete
    ex.device_lane = DeviceLane(ex.store, ex.fmt.kernel, ex.num_experts)
    return ex.device_lane


def test_the_host_lane_reads_the_routers_choice_twice_per_moe_layer(gpu_path_model) -> None:
    """What the device lane removes: the host lane reads ids and weights in every MoE layer."""
    om = gpu_path_model
    assert om.executor.device_lane is None  # a CPU executor keeps the host lane
    per_step, lines = _reads_per_step(om, list(range(3, 19)), 6)
    layers = len({k // om.executor.num_experts for k in om.executor.store.res.slot_of})
    assert per_step == 2 * layers + 1, lines


def test_device_lane_decodes_with_one_host_read_per_step(gpu_path_model) -> None:
    om = gpu_path_model
    prompt = list(range(3, 19))
    ref_tokens = generate(om, prompt, SamplingParams(max_tokens=8, ignore_eos=True)).tokens
    ref_logits = prompt_logits(om, prompt[:1])
    _force_device_lane(om)
    per_step, lines = _reads_per_step(om, prompt, 6)
    assert per_step == 1, lines
    assert [line.split(":")[0] for line in lines] == ["engine/worker/sampling.py"], (
        lines
    )  # greedy_token
    assert generate(om, prompt, SamplingParams(max_tokens=8, ignore_eos=True)).tokens == ref_tokens
    torch.testing.assert_close(prompt_logits(om, prompt[:1]), ref_logits, rtol=1e-5, atol=1e-5)
