"""The GPU measurement in one command (issue 40). Run through bench/gpu_real.sh, which runs the
CUDA-marked tests first and then this driver; `--dry-run` runs the same on a CPU at toy sizes.

Measures, on one device, in three groups whose cells run in interleaved rounds after a warm-up
round (ratios are medians over rounds of cell / baseline in the same round):
1. the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, moe_intermediate 768; random
   weights, bf16) at a depth that fits the time: the engine at cache 1.0 against transformers
   with the whole model on the device, and the host synchronizations per token of both;
2. the same checkpoint at a 24 GiB device budget, scaled to its depth: the engine's memory plan for
   the full 48-layer model at --device-memory 24GiB keeps a share of the experts on the device, and
   every system here gets that share: fetch-all (LRU, on-demand loads), speed-first, and
   transformers under accelerate's offload with the same bytes of weights on the device;
3. the embedded pair (models/embedded: a trained target with its draft and SpecPrefetch adapter;
   the random checkpoint has neither) at the same expert share: fetch-all, MoE-SpAc (draft
   speculation + utility prefetch and eviction + CPU-run experts) and SpecPrefetch.
Also the copy bandwidth: pinned and pageable host-to-device against the engine's own copy rate.

Writes {"device", "targets": {name: {"measured", "target", "met"}}, "cells": [...]} with the command
behind every figure: docs/benchmarks/gpu_real.json on a GPU, .cache/gpu_real/dry_run.json in a dry
run. Random weights route with less locality than a trained model: cache figures of group 2 are
pessimistic stand-ins for a real Qwen3-30B-A3B.

    bash bench/gpu_real.sh            # on a GPU machine: <= 8 minutes
    bash bench/gpu_real.sh --dry-run  # on a CPU: every step a CPU can run, at toy sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench import gpu_real_cells as cells
from bench import spec_bench
from bench.gpu_check import copy_figures
from bench.real_shapes import TINY_WIDTHS
from bench.report import cut_prompts, interleaved, positive_int
from bench.spac_bench import SPEC
from engine import DeviceLane, EngineConfig, SpecConfig, load_model, portable_path
from models import EMBEDDED_TARGET

GPU_OUT = Path("docs/benchmarks/gpu_real.json")
DRY_OUT = Path(".cache/gpu_real/dry_run.json")
OFF = SpecConfig(speculative="off")


@dataclass(frozen=True)
class Sizes:
    layers: int
    widths: dict[str, Any] = field(default_factory=dict)
    tokens: int = 32
    offload_tokens: int = 8  # accelerate's offload moves most of the model per token: fewer tokens
    rounds: int = 2
    prompt_tokens: int = 32
    copy_mib: int = 256
    matmul_dim: int = 4096


GPU_SIZES = Sizes(layers=8)
DRY_SIZES = Sizes(
    layers=2,
    widths=TINY_WIDTHS[cells.MODEL],
    tokens=6,
    offload_tokens=3,
    rounds=1,
    prompt_tokens=16,
    copy_mib=4,
    matmul_dim=128,
)

# name: (cell, baseline cell, target ratio)
TARGETS = {
    "cache 1.0 vs transformers": ("q30 engine cache 1.0", "q30 transformers", 1.2),
    "24 GiB: fetch-all vs accelerate offload": (
        "q30@24GiB fetch-all",
        "q30@24GiB accelerate offload",
        3.0,
    ),
    "24 GiB: speed-first vs fetch-all": ("q30@24GiB speed-first", "q30@24GiB fetch-all", 2.5),
    "24 GiB share: MoE-SpAc vs fetch-all": (
        "embedded@24GiB-share MoE-SpAc",
        "embedded@24GiB-share fetch-all",
        2.0,
    ),
    "24 GiB share: SpecPrefetch vs fetch-all": (
        "embedded@24GiB-share SpecPrefetch",
        "embedded@24GiB-share fetch-all",
        1.15,
    ),
}


@dataclass
class System:
    """One cell of a group: how to measure it once (-> figures with tok_s), what to close after."""

    name: str
    model: str
    command: str
    measure: Callable[[], dict[str, Any]]
    close: Callable[[], None] = lambda: None
    cpu_equivalent: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _finite(x: Any) -> Any:
    """`x` with NaN and infinities as null: strict JSON has no NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "accelerate"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


class Run:
    """The JSON being built, written after every group so a run cut short keeps what it measured."""

    def __init__(self, out: Path, device: str, command: str) -> None:
        self.out = out
        self.doc: dict[str, Any] = {
            "device": device,
            "versions": _versions(),
            "command": command,
            "weights": "random stand-ins (bench/real_shapes.py) for the Qwen3-30B-A3B shape; "
            "the embedded pair is this project's trained model",
            "targets": {},
            "cells": [],
        }
        self.rounds: dict[str, list[dict[str, Any]]] = {}
        self.pinned_gb_s = float("nan")  # the link's peak, once measured

    def add(self, cell: dict[str, Any]) -> None:
        self.doc["cells"].append(cell)
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(_finite(self.doc), indent=2, default=str) + "\n")

    def group(self, group: str, systems: list[System], rounds: int) -> None:
        """Interleaved rounds over `systems`; one cell each with the medians of its figures."""
        by_name = {s.name: s for s in systems}
        try:
            res = interleaved(list(by_name), rounds, lambda n: by_name[n].measure())
        finally:
            for s in systems:
                s.close()
            spec_bench._SPECULATION.clear()  # proposers of the engines just closed
            gc.collect()  # the next group gets the device memory back
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for name, runs in res.items():
            s = by_name[name]
            self.rounds[name] = runs
            numeric = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
            figures = {k: statistics.median(r[k] for r in runs) for k in numeric}
            if "copy_gb_s" in figures:
                figures["copy_of_pinned_peak"] = figures["copy_gb_s"] / self.pinned_gb_s
            self.add(
                {
                    "name": name,
                    "group": group,
                    "model": s.model,
                    "command": s.command,
                    "figures": figures,
                    "tok_s_by_round": [r["tok_s"] for r in runs],
                    "cpu_equivalent": s.cpu_equivalent,
                    **s.info,
                }
            )

    def targets(self) -> None:
        for name, (cell, base, target) in TARGETS.items():
            a, b = self.rounds.get(cell), self.rounds.get(base)
            measured = (
                statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(a, b))
                if a and b
                else None
            )
            self.doc["targets"][name] = {
                "measured": measured,
                "target": target,
                "met": measured is not None and measured >= target,
                "cell": cell,
                "baseline": base,
            }
        self.write()


@dataclass(frozen=True)
class Setup:
    """What every group shares: the device, the sizes, the checkpoint and its prompt."""

    device: torch.device
    dry: bool
    sizes: Sizes
    q30: Path
    prompt: list[int]
    work: Path

    @property
    def base(self) -> dict[str, Any]:
        """Settings of every engine cell: on a dry run torch's kernels, the path a GPU takes."""
        return dict(device=self.device.type, native_kernels="off" if self.dry else "auto")

    def note(self, text: str) -> str | None:
        """A cell's `cpu_equivalent`: the text on a dry run, None on the GPU."""
        return text if self.dry else None


def engine_system(
    setup: Setup,
    name: str,
    model: Path,
    cfg: EngineConfig,
    spec: SpecConfig = OFF,
    prompts: list[list[int]] | None = None,
) -> tuple[System, Any]:
    om = load_model(model, cfg)
    note = setup.note("CPU: the fast tier is host memory, the slow tier's copies host to host")
    ex = om.executor
    if setup.dry and ex.store.complete and DeviceLane.supports(ex.fmt):
        ex.device_lane = DeviceLane(ex.store, ex.fmt.kernel, ex.num_experts)
        note = "CPU: the resident lane's device lane forced on, as a CUDA executor takes it"
    rows = prompts or [setup.prompt]
    system = System(
        name,
        portable_path(model),
        cells.engine_flags(model, cfg, spec),
        lambda: cells.engine_figures(spec_bench.run_cell(om, spec, rows, setup.sizes.tokens)),
        om.close,
        note,
    )
    return system, om


def hf_system(name: str, model: Any, setup: Setup, tokens: int, command: str, **kw: Any) -> System:
    """transformers' generate as a cell; closing it drops the model (its device memory)."""
    held = {"model": model}
    return System(
        name,
        portable_path(setup.q30),
        command,
        lambda: cells.hf_figures(held["model"], setup.prompt, tokens),
        held.clear,
        **kw,
    )


def cache_one(run: Run, setup: Setup) -> None:
    """Group 1: the engine at cache 1.0 against transformers, and both's host syncs per token."""
    hf = cells.load_hf(setup.q30, setup.device)
    cfg = EngineConfig(cache_fraction=1.0, dtype="bfloat16", **setup.base)
    engine, om = engine_system(setup, "q30 engine cache 1.0", setup.q30, cfg)
    n = setup.sizes.tokens
    syncs = {
        "q30 transformers": cells.host_syncs(cells.hf_generate(hf, setup.prompt), setup.device, n),
        "q30 engine cache 1.0": cells.host_syncs(
            cells.engine_generate(om, setup.prompt), setup.device, n
        ),
    }
    cmd = "transformers generate (bf16, the whole model on the device)"
    run.group(
        "cache 1.0", [hf_system("q30 transformers", hf, setup, n, cmd), engine], setup.sizes.rounds
    )
    del hf
    run.add(
        {
            "name": "host syncs per token",
            "group": "cache 1.0",
            "command": "torch.profiler (CUDA) and engine/worker/host_reads.py",
            "figures": syncs,
            "cpu_equivalent": setup.note(
                "host reads counted by a TorchFunctionMode; no CUDA calls to count"
            ),
        }
    )


def at_budget(run: Run, setup: Setup, share: float) -> None:
    """Group 2: at the 24 GiB expert share, fetch-all and speed-first against accelerate's offload."""
    budget = cells.weights_on_device(setup.q30, share)
    offloaded, placement = cells.load_hf_offloaded(
        setup.q30, setup.device, budget, setup.work / "offload"
    )
    at = dict(setup.base, dtype="bfloat16", cache_fraction=share, offload="ram", prefetch="none")
    fetch_all, om = engine_system(
        setup,
        "q30@24GiB fetch-all",
        setup.q30,
        EngineConfig(policy="fetch-all", eviction="lru", **at),
    )
    speed, _ = engine_system(
        setup, "q30@24GiB speed-first", setup.q30, EngineConfig(policy="speed-first", **at)
    )
    acc = hf_system(
        "q30@24GiB accelerate offload",
        offloaded,
        setup,
        setup.sizes.offload_tokens,
        f"transformers generate, device_map=auto, max_memory {budget} B on the device (accelerate)",
        info=placement,
        cpu_equivalent=setup.note(
            "CPU: accelerate's disk offload under a host budget stands in for its CPU offload"
        ),
    )
    syncs = cells.host_syncs(
        cells.engine_generate(om, setup.prompt), setup.device, setup.sizes.tokens
    )
    del offloaded
    run.group("24 GiB", [acc, fetch_all, speed], setup.sizes.rounds)
    run.add(
        {
            "name": "host syncs per token, fetch-all at 24 GiB",
            "group": "24 GiB",
            "command": "torch.profiler (CUDA) and engine/worker/host_reads.py",
            "figures": syncs,
            "cpu_equivalent": setup.note("host reads counted by a TorchFunctionMode"),
        }
    )


def embedded_at_share(run: Run, setup: Setup, share: float) -> None:
    """Group 3: the embedded pair (draft and SpecPrefetch adapter shipped) at the same expert share."""
    from transformers import AutoTokenizer

    emb = EMBEDDED_TARGET
    tok = AutoTokenizer.from_pretrained(emb)
    prompts = cut_prompts(tok, emb.parent / "data" / "test.txt", 1, setup.sizes.prompt_tokens)
    at = dict(setup.base, cache_fraction=share, offload="ram")
    configs = {
        "embedded@24GiB-share fetch-all": (
            EngineConfig(policy="fetch-all", eviction="lru", prefetch="none", **at),
            OFF,
        ),
        "embedded@24GiB-share MoE-SpAc": (
            EngineConfig(prefetch="utility", eviction="utility", cpu_experts="auto", **at),
            SPEC,
        ),
        "embedded@24GiB-share SpecPrefetch": (EngineConfig(prefetch="adapter", **at), OFF),
    }
    systems = [engine_system(setup, n, emb, c, s, prompts)[0] for n, (c, s) in configs.items()]
    if setup.dry:
        systems[1].cpu_equivalent = "CPU: CPU-run experts and the fast tier share the same CPU"
    run.group("embedded at the 24 GiB share", systems, setup.sizes.rounds)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="on a CPU, at toy sizes (device 'cpu (dry run)')"
    )
    ap.add_argument(
        "--out", type=Path, help=f"the JSON (default {GPU_OUT}; {DRY_OUT} with --dry-run)"
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/gpu_real"),
        help="where checkpoints are built (default .cache/gpu_real)",
    )
    ap.add_argument(
        "--layers",
        type=positive_int,
        help="decoder layers of the Qwen3-30B-A3B-shaped checkpoint (default 8; 2 with --dry-run)",
    )
    ap.add_argument(
        "--budget", default="24GiB", help="device budget of the full-depth model (default 24GiB)"
    )
    ap.add_argument(
        "--tests-log", type=Path, help="the CUDA-marked tests' pytest log (gpu_real.sh passes it)"
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    dry = args.dry_run
    out = args.out or (DRY_OUT if dry else GPU_OUT)
    if dry and out.resolve() == GPU_OUT.resolve():
        raise SystemExit(f"gpu_real: a dry run never writes {GPU_OUT}; pass another --out")
    if not dry and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_real: no CUDA GPU visible (torch.cuda.is_available() is False); use --dry-run on a CPU"
        )
    sizes = DRY_SIZES if dry else GPU_SIZES
    if args.layers:
        sizes = replace(sizes, layers=args.layers)
    device = torch.device("cpu" if dry else "cuda")
    run = Run(
        out,
        "cpu (dry run)" if dry else torch.cuda.get_device_name(0),
        "bash bench/gpu_real.sh" + (" --dry-run" if dry else ""),
    )
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    run.doc["phases_s"] = phases

    def lap(phase: str) -> None:
        phases[phase] = round(time.perf_counter() - t0 - sum(phases.values()), 1)
        print(f"== {phase}: {phases[phase]} s", flush=True)

    run.add(
        {
            "name": "cuda tests",
            "group": "tests",
            "command": "pytest -m cuda (bench/gpu_real.sh)",
            "figures": cells.tests_cell(args.tests_log),
            "cpu_equivalent": "no CUDA: the cuda-marked tests are collected and skipped"
            if dry
            else None,
        }
    )
    q30 = cells.build_checkpoint(args.work, sizes.layers, sizes.widths, device.type)
    share = cells.expert_share(args.work, args.budget)
    run.doc["budget"] = share
    lap("checkpoints and budget")
    copies = copy_figures(device, mib=sizes.copy_mib, matmul_dim=sizes.matmul_dim)
    run.pinned_gb_s = copies["pinned_gb_s"]
    run.add(
        {
            "name": "copy bandwidth",
            "group": "copies",
            "command": "bench.gpu_check.copy_figures",
            "figures": copies,
            "cpu_equivalent": "host-to-host copies, no pinned memory or side stream"
            if dry
            else None,
        }
    )
    lap("copies")
    vocab = json.loads((q30 / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (sizes.prompt_tokens,), generator=gen).tolist()
    setup = Setup(device, dry, sizes, q30, prompt, args.work)
    f = share["share"]
    failed = []
    for phase, measure in (
        ("cache 1.0", lambda: cache_one(run, setup)),
        ("24 GiB", lambda: at_budget(run, setup, f)),
        ("embedded", lambda: embedded_at_share(run, setup, f)),
    ):
        try:
            measure()
        except Exception as e:  # one group's failure must not cost the others their minutes
            traceback.print_exc()
            failed.append(phase)
            run.add(
                {"name": f"{phase}: failed", "group": phase, "error": f"{type(e).__name__}: {e}"}
            )
        lap(phase)
    run.targets()
    print(json.dumps(run.doc["targets"], indent=2))
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"gpu_real: {', '.join(failed)} failed (their error cells are in {out})")


if __name__ == "__main__":
    main()
