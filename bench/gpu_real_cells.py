"""The pieces bench/gpu_real.py measures with: checkpoints, the 24 GiB expert share, and one cell of
each kind (the engine, transformers on the device, transformers under accelerate's offload, host
synchronizations, copy bandwidth, the CUDA-marked tests' log). Each cell returns plain figures
and says, where it ran on a CPU, what stood in for the CUDA-only step (`cpu_equivalent`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import hf_decode
from bench.real_shapes import write_checkpoint
from engine import EngineConfig, HostReads, SamplingParams, SpecConfig, generate

MODEL = "qwen3-30b-a3b"
FULL_LAYERS = 48  # Qwen3-30B-A3B's depth


def build_checkpoint(work: Path, layers: int, widths: dict[str, Any], device: str) -> Path:
    """The random-weight Qwen3-30B-A3B layer shape at `layers` decoder layers (toy widths where
    `widths` cut them), its random numbers drawn on `device`, built once under `work`; a
    `.complete` file marks a finished build."""
    out = work / (f"q30-{layers}l" + ("-toy" if widths else ""))
    if not (out / ".complete").exists():
        write_checkpoint(out, MODEL, layers, progress=False, device=device, **widths)
        (out / ".complete").write_text("written by bench/gpu_real.py\n")
    return out


def expert_share(work: Path, device_memory: str) -> dict[str, Any]:
    """The share of routed experts the engine's memory plan keeps on a GPU of `device_memory` for the
    full 48-layer model in bf16 (headers-only checkpoint: no weight written or read), with the host
    taken as the GPU machine's 128 GiB. The same share applies at any depth."""
    from engine import HostMemory, plan_memory, probe_checkpoint

    sparse = work / "q30-48l-headers"
    if not (sparse / ".complete").exists():
        write_checkpoint(sparse, MODEL, FULL_LAYERS, progress=False, sparse=True)
        (sparse / ".complete").write_text("headers only (file holes): bench/gpu_real.py\n")
    cfg = EngineConfig(dtype="bfloat16", device_memory=device_memory, offload="ram")
    fp = probe_checkpoint(sparse, dataclasses.replace(cfg, device="cpu")).footprint
    host = HostMemory(128 << 30, "the GPU machine's 128 GiB (stated)", None, None)
    plan = plan_memory(fp, cfg, "cuda", host)
    return {
        "device_memory": device_memory,
        "full_depth_layers": FULL_LAYERS,
        "share": plan.n_slots / plan.total_experts,
        "slots": plan.n_slots,
        "experts": plan.total_experts,
        "why": "the engine's memory plan for the 48-layer model in bf16 at --device-memory "
        f"{device_memory} (default KV reservation): this share of routed experts on the device, "
        "applied to the shorter checkpoint measured here",
    }


def weights_on_device(model_dir: Path, share: float) -> int:
    """Bytes of weights the engine holds on the device at `share`: dense part + that share of the
    experts (the budget accelerate's offload gets, so both hold the same bytes of weights there)."""
    from engine import probe_checkpoint

    fp = probe_checkpoint(model_dir, EngineConfig(dtype="bfloat16", device="cpu")).footprint
    return fp.dense_bytes + round(share * fp.total_experts) * fp.slot_bytes


def engine_flags(model: Path, cfg: EngineConfig, spec: SpecConfig) -> str:
    """The `moe-offload generate` command line equivalent to these settings (non-default fields)."""
    from engine import portable_path

    parts = [f"moe-offload generate --model {portable_path(model)}"]
    for obj in (cfg, spec):
        for f in dataclasses.fields(obj):
            value, flag = getattr(obj, f.name), f.metadata.get("flag")
            if value == f.default or "help" not in f.metadata:
                continue
            if isinstance(value, bool):
                parts.append(flag or f"--{f.name.replace('_', '-')}")
            else:
                parts.append(f"--{f.name.replace('_', '-')} {value}")
    return " ".join(parts)


def engine_figures(run: dict[str, Any]) -> dict[str, float]:
    """Per-token figures of a spec_bench.run_cell result: tok/s, H2D (slow-tier) bytes, stall share,
    hit rate and the engine's own copy rate (bytes over transfer seconds)."""
    s = run["stats"]
    seconds = sum(s["transfer_seconds"].values())
    return {
        "tok_s": run["tok_s"],
        "h2d_bytes_per_token": run["bytes_per_token"],
        "stall_share": run["stall_share"],
        "hit_rate": s["hit_rate"],
        "copy_gb_s": s["bytes_moved"] / seconds / 1e9 if seconds > 0 else float("nan"),
        "tokens_per_verification": (s["spec_accepted_tokens"] / s["spec_drafts"] + 1)
        if s["spec_drafts"]
        else 1.0,
    }


def hf_figures(model: torch.nn.Module, prompt: list[int], tokens: int) -> dict[str, float]:
    return {"tok_s": hf_decode(model, prompt, tokens)[0]}


def load_hf(model_dir: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()


def load_hf_offloaded(
    model_dir: Path, device: torch.device, budget: int, offload_dir: Path
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """transformers with accelerate's big-model offload: `device_map="auto"` under a device budget of
    `budget` bytes, the rest in host RAM, moved to the device module by module in each forward.
    On a CPU there is no device to offload from: the budget applies to host memory and the rest is
    offloaded to disk (accelerate's disk offload), the CPU equivalent of the same hooks."""
    from transformers import AutoModelForCausalLM

    if device.type == "cuda":
        max_memory: dict[Any, Any] = {device.index or 0: budget, "cpu": 100 << 30}
        extra: dict[str, Any] = {}
    else:
        max_memory = {"cpu": budget, "disk": 1 << 40}
        extra = {"offload_folder": str(offload_dir)}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map="auto", max_memory=max_memory, **extra
    ).eval()
    placed: dict[str, int] = {}
    for where in model.hf_device_map.values():
        placed[str(where)] = placed.get(str(where), 0) + 1
    return model, {"budget_bytes": budget, "modules_by_place": placed}


def host_syncs(run: Callable[[int], Any], device: torch.device, tokens: int) -> dict[str, Any]:
    """Host synchronizations per decode token of `run(n)` (which generates n tokens): everywhere, the
    host reads of tensor values counted by engine/worker/host_reads.py, of a call of `tokens` less
    one of 1 token (the prefill's reads cancel), per token; on CUDA also the CUDA runtime's sync
    and copy calls of the whole call counted by torch.profiler (bench/gpu_profile.py)."""
    run(tokens)  # warm-up
    with HostReads() as one:
        run(1)
    with HostReads() as reads:
        run(tokens)
    out: dict[str, Any] = {
        "host_reads_per_decode_token": (reads.total - one.total) / (tokens - 1),
        "host_reads_by_line": dict((reads.by_line - one.by_line).most_common(8)),
    }
    if device.type == "cuda":
        from bench.gpu_profile import profile_tokens

        prof = profile_tokens(lambda: run(tokens), device, tokens)
        calls = prof["host_device_calls"]
        out["cuda_syncs_per_token"] = sum(v for k, v in calls.items() if "Synchronize" in k)
        out["cuda_calls_per_token"] = calls
        out["kernels_per_token"] = prof["kernels"]
    return out


def engine_generate(om: Any, prompt: list[int]) -> Callable[[int], Any]:
    return lambda n: generate(om, prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def hf_generate(model: torch.nn.Module, prompt: list[int]) -> Callable[[int], Any]:
    return lambda n: hf_decode(model, prompt, n)


def tests_cell(log: Path | None) -> dict[str, Any]:
    """The CUDA-marked tests' pytest summary ("8 passed in 18.2s") from the log gpu_real.sh wrote."""
    text = log.read_text(errors="replace") if log is not None and log.exists() else ""
    counts = {
        k: int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", text)
    }
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
        "skipped": counts.get("skipped", 0),
        "summary": text.strip().splitlines()[-1] if text.strip() else "no log",
    }
