"""Bigger than memory at released shapes: the engine's `--offload disk` beside llama.cpp's mmap, both
under the same memory cgroup (its page cache counts against the limit), from one interleaved run.

Cells (bench/real_shapes_bench.py --bigger-than-ram runs them):
  - Qwen3-30B-A3B at --layers of 48 (random weights, bf16 as released) under each --limits cgroup:
    engine bf16 experts / llama.cpp bf16 GGUF, and engine int8 experts / llama.cpp Q8_0 (experts
    quantized, dense bf16 in both: equal bits);
  - gpt-oss-20b at full depth (random weights, MXFP4 experts as released) under the --oss-limit cgroup:
    engine MXFP4 experts (stored and read as shipped, dequantized on compute) / llama.cpp's MXFP4 GGUF.
Each engine cell plans its own memory inside the cgroup (`--offload disk`, no cache flag) and decodes
greedily; it reports decode tok/s, the bytes its disk tier read a decode token, the disk's delivered
bandwidth (bytes over the wall time with a read in flight, beside dd O_DIRECT runs right before and
right after the cell: a shared disk's rate moves), and Belady's MIN on the same accesses
(engine/offline/belady.py: the fewest loads any policy could make with the same fast tier). llama.cpp
runs `llama-bench -lm mmap --repack 0` under the same cgroup (repacking would copy MXFP4 weights into
anonymous memory, which a cgroup smaller than the model cannot hold); its bytes read a token come from the kernel's
read_bytes of a run of N tokens less one of a single token.

A child process of `python -m bench.bigger_than_ram --cell JSON` is one engine cell; it prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT = (
    16  # prompt tokens before the measured decode (ids below the builder's 512-token vocabulary)
)
# The engine samples (temperature 1, seed 0): greedy decoding of random weights falls into a loop of a
# few tokens that reuse the same experts, while llama-bench decodes random tokens. A random model's
# near-flat distribution gives near-random tokens, so both route like random text; the seed makes the
# tokens reproducible, so the cgroup and reference runs can be compared token for token.
DECODE_MAX_MODEL_LEN = 2048  # the KV reservation the engine cells plan for: one sequence of this


# -- one engine cell (in its own process, inside the cgroup) -------------------------------------
def engine_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Load spec["ckpt"] with spec["fields"] (EngineConfig) to its own memory plan, warm up, then decode
    spec["tokens"] greedy tokens with the accesses recorded."""
    import torch

    from engine import (
        EngineConfig,
        KvRequest,
        SamplingParams,
        flatten,
        generate,
        load_model,
        lru_loads,
        min_loads,
    )

    def SAMPLED(n: int) -> SamplingParams:  # noqa: N802 (reads as a constant)
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, seed=0)

    torch.set_num_threads(spec.get("threads", 1))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 512, (PROMPT,), generator=gen).tolist()
    t0 = time.perf_counter()
    om = load_model(
        spec["ckpt"],
        EngineConfig(prefix_cache_bytes=0, **spec["fields"]),
        KvRequest(max_model_len=DECODE_MAX_MODEL_LEN, max_running=1),
    )
    load_s = time.perf_counter() - t0
    plan = om.memory_plan
    try:
        generate(om, prompt, SAMPLED(4))  # first calls
        E = om.num_experts
        index = {layer: i for i, layer in enumerate(om.moe_layers)}
        store, reader = om.transfers.store, om.transfers.tier.reader
        resident: list[int] = []  # the fast tier as the decode starts (after the prompt's prefill)
        accesses: list[list[int]] = []
        routes: list[tuple[list[int], list[float]]] = []  # per decode layer: ids, gate weights
        first: dict[str, Any] = {}

        def listen(ev: Any) -> None:
            if ev.ids.shape[0] != 1:
                return  # the prompt's prefill
            if not first:  # before the first decode layer's experts run: the decode starts here
                first.update(stats=om.stats.snapshot(), clock=reader.clock.snapshot())
                resident.extend(k for k in range(len(index) * E) if store.is_resident(k))
            base = index[ev.layer] * E
            accesses.append([base + int(e) for e in ev.ids[0].tolist()])
            routes.append((ev.ids[0].tolist(), ev.weights[0].float().tolist()))

        unsubscribe = om.bus.subscribe(listen)
        try:
            c = generate(om, prompt, SAMPLED(spec["tokens"] + 1))
        finally:
            unsubscribe()
        s, clock = om.stats.snapshot(), reader.clock.snapshot()
        decode_tokens = len(c.token_ids) - 1  # the first token comes from the prefill
        loads = s["misses"] - first["stats"]["misses"]
        nbytes = clock["bytes"] - first["clock"]["bytes"]
        busy = clock["busy_seconds"] - first["clock"]["busy_seconds"]
        locator = om.transfers.tier.locator
        expert_bytes = locator.nbytes_on_disk(om.moe_layers[0], 0)
        read_file = str(locator.segments(om.moe_layers[0], 0)[0].path)  # what dd should read too
        seq = flatten(accesses)
        if spec.get("trace"):
            save_decode_trace(spec["trace"], routes, om)
        best = min_loads(seq, plan.n_slots, resident)
        return {
            "tokens": c.token_ids,
            "decode_tps": c.decode_tokens_per_s,
            "load_s": load_s,
            "n_slots": plan.n_slots,
            "total_experts": plan.total_experts,
            "host_budget": plan.host_budget,
            "host_source": plan.host_source,
            "offload": plan.offload,
            "expert_bytes": expert_bytes,
            "read_file": read_file,
            "loads_per_token": loads / decode_tokens,
            "bytes_per_token": nbytes / decode_tokens,
            "read_gb_s": nbytes / busy / 1e9 if busy else float("nan"),
            "read_busy_share": busy / c.decode_seconds if c.decode_seconds else float("nan"),
            "min_loads_per_token": best / decode_tokens,
            "min_bytes_per_token": best * expert_bytes / decode_tokens,
            # Two online references on the same accesses: plain LRU, and what any policy without
            # foresight expects if routing were uniform and independent (each access resident with
            # probability slots / experts): random weights route close to that.
            "lru_loads_per_token": lru_loads(seq, plan.n_slots, resident) / decode_tokens,
            "uniform_online_loads_per_token": len(seq)
            * (1 - plan.n_slots / plan.total_experts)
            / decode_tokens,
            "stall_s_per_token": (s["stall_seconds"] - first["stats"]["stall_seconds"])
            / decode_tokens,
        }
    finally:
        om.close()


def save_decode_trace(path: str, routes: list[tuple[list[int], list[float]]], om: Any) -> None:
    """The decode's routing as a router trace (engine/offline/trace.py's format), so `moe-offload
    plan --trace` projects the accesses this run made instead of the embedded model's."""
    import numpy as np

    from engine import save_trace

    L = len(om.moe_layers)
    n = len(routes) // L
    ids = np.asarray([r[0] for r in routes[: n * L]], dtype=np.int16).reshape(n, L, -1)
    weights = np.asarray([r[1] for r in routes[: n * L]], dtype=np.float32).reshape(n, L, -1)
    meta = {
        "model": "bench decode",
        "moe_layers": list(om.moe_layers),
        "num_experts": om.num_experts,
        "top_k": om.top_k,
        "window": 1,
        "expert_nbytes": om.transfers.tier.locator.nbytes_on_disk(om.moe_layers[0], 0),
    }
    save_trace(
        {
            "tokens": np.zeros(n, dtype=np.int32),
            "ids": ids,
            "weights": weights,
            "meta": np.asarray(json.dumps(meta)),
        },
        path,
    )


# -- the pieces the parent runs ------------------------------------------------------------------
def peak(cgroup: Any) -> int | None:
    """The group's peak usage since the last `reset_peak` (v1 max_usage_in_bytes, v2 memory.peak)."""
    f = cgroup.path / ("memory.max_usage_in_bytes" if cgroup.version == 1 else "memory.peak")
    return int(f.read_text()) if f.exists() else None


def reset_peak(cgroup: Any) -> None:
    if cgroup.version == 1:
        (cgroup.path / "memory.max_usage_in_bytes").write_text("0")


def run_engine(spec: dict[str, Any], cgroup: Any | None, cold: list[Path]) -> dict[str, Any]:
    """One engine cell in a child process, inside `cgroup` (a bench.cgroup.MemoryCgroup) or not."""
    from bench.cgroup import evict_page_cache

    argv = [sys.executable, "-m", "bench.bigger_than_ram", "--cell", json.dumps(spec)]
    if cgroup is None:
        for f in cold:
            evict_page_cache(f)
        res = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    else:
        reset_peak(cgroup)
        res = cgroup.run(argv, cold=cold)
    if res.returncode != 0:
        raise RuntimeError(
            f"engine cell {spec['fields']} failed (exit {res.returncode}): {res.stderr[-2000:]}"
        )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if cgroup is not None:
        out["cgroup_peak"] = peak(cgroup)
    return out


def run_llama(
    src: Path, gguf: Path, tokens: int, cgroup: Any, measure_bytes: bool
) -> dict[str, Any]:
    """llama-bench decode of `tokens` tokens, mmap only (no repacking), inside `cgroup` from a cold page cache; with
    `measure_bytes`, also a one-token run, so read_bytes(N) - read_bytes(1) over N - 1 is a token's reads."""

    exe = src / "build/bin/llama-bench"
    # Builds with weight repacking (on by default) copy the types it repacks (MXFP4 here) into
    # anonymous memory at load, so a model bigger than the cgroup is killed instead of read by mmap.
    helps = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    repack = " --repack 0" if "--repack" in helps.stdout + helps.stderr else ""

    def bench(n: int) -> tuple[float, int]:
        cmd = (
            f"'{exe}' -m '{gguf}' -p 0 -n {n} -t 1 -r 1 -o json -lm mmap{repack}"
            " && grep ^read_bytes /proc/$$/io"  # the shell's counters include its reaped child's
        )
        reset_peak(cgroup)
        res = cgroup.run(["sh", "-c", cmd], cold=[gguf])
        if res.returncode != 0:
            raise RuntimeError(f"llama-bench on {gguf.name} failed: {res.stderr[-2000:]}")
        text = res.stdout
        read = int(re.findall(r"^read_bytes:\s*(\d+)", text, re.M)[-1])
        rows = json.loads(text[: text.rindex("]") + 1])
        return max(float(r["avg_ts"]) for r in rows), read

    tps, read = bench(tokens)
    out: dict[str, Any] = {"decode_tps": tps, "cgroup_peak": peak(cgroup)}
    if measure_bytes:
        _, read1 = bench(1)
        out["bytes_per_token"] = (read - read1) / max(1, tokens - 1)
    return out


def dd_direct(path: Path, block: int, nbytes: int = 2 << 30) -> float:
    """GB/s of `dd iflag=direct` reading `nbytes` of `path` in blocks of `block` bytes."""
    res = subprocess.run(
        [
            "dd",
            f"if={path}",
            "of=/dev/null",
            f"bs={block}",
            f"count={max(1, nbytes // block)}",
            "iflag=direct",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"(\d+) bytes.*copied, ([\d.]+) s", res.stderr)
    if m is None:
        raise RuntimeError(f"dd said: {res.stderr}")
    return int(m.group(1)) / float(m.group(2)) / 1e9


DD_BYTES = 1 << 30  # what each dd beside an engine cell reads


def dd_block(expert_bytes: int | None) -> int:
    """dd's block: one expert read, rounded up to 4 KiB (O_DIRECT's alignment); 1 MiB before the
    first cell of a kind has said its expert size."""
    return -(-expert_bytes // 4096) * 4096 if expert_bytes else 1 << 20


def plan_projection(ckpt: Path, cgroup: Any, extra: list[str]) -> dict[str, Any]:
    """`moe-offload plan` run inside `cgroup` (so it plans for the cgroup's memory): the fast tier it
    chose and its projected fetch-all decode tok/s."""
    res = cgroup.run(
        [
            sys.executable,
            "-m",
            "cli",
            "plan",
            "--model",
            str(ckpt),
            "--offload",
            "disk",
            "--max-running",
            "1",
            "--max-model-len",
            str(DECODE_MAX_MODEL_LEN),
            *extra,
        ]
    )
    if res.returncode != 0:
        raise RuntimeError(f"moe-offload plan failed: {res.stderr[-2000:]}")
    m = re.search(r"^\s*fetch-all\s+([\d.]+)", res.stdout, re.M)
    slots = re.search(r"(\d+) of (\d+) experts", res.stdout)
    return {
        "projected_tps": float(m.group(1)) if m else None,
        "n_slots": int(slots.group(1)) if slots else None,
        "text": res.stdout,
    }


@dataclass(frozen=True)
class Cell:
    """One comparison: `engine` experts against llama.cpp's `gguf` file of `model`, under `limit_gib`."""

    model: str  # a key of MODELS
    limit_gib: float
    engine: str  # a key of ENGINE_FIELDS
    gguf: str  # "bf16" or "mxfp4" (the converter's output) or a llama-quantize kind (QUANT_TYPES)

    @property
    def name(self) -> str:
        return f"{self.model} {self.engine} / {self.gguf}, {self.limit_gib:g} GiB"


MODELS = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "gpt-oss-20b": "gpt-oss-20b"}
ENGINE_FIELDS: dict[str, dict[str, Any]] = {
    "bf16": {"offload": "disk", "dtype": "bfloat16"},
    "int8": {"offload": "disk", "dtype": "bfloat16", "expert_quant": "int8"},
    "mxfp4": {"offload": "disk", "dtype": "bfloat16"},  # gpt-oss's experts as shipped
}
PLAN_FLAGS = {
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--expert-quant", "int8"],
}
REFERENCE_HOST_MEMORY = "8GiB"  # the reference run: no cgroup, a larger fast tier than any cell's


def cells(
    limits: list[float], oss_limit: float | None, kinds: tuple[str, ...] = ("bf16", "int8", "mxfp4")
) -> list[Cell]:
    """The cells to run: Qwen3 bf16 and int8 pairs at each limit, gpt-oss MXFP4 at `oss_limit`, the
    engine kinds limited to `kinds`."""
    out = [
        Cell("qwen3-30b-a3b", g, e, k)
        for g in limits
        for e, k in (("bf16", "bf16"), ("int8", "q8_0"))
        if e in kinds
    ]
    if oss_limit and "mxfp4" in kinds:
        out.append(Cell("gpt-oss-20b", oss_limit, "mxfp4", "mxfp4"))
    return out


def build_files(src: Path | None, work: Path, layers: int, todo: list[Cell]) -> dict[str, Any]:
    """The checkpoints and GGUF files the cells need (each built once, under `work`)."""
    from bench.peers import build_target, convert
    from bench.real_shapes import write_checkpoint
    from bench.real_shapes_files import QUANT_TYPES, build_checkpoint

    ckpts: dict[str, Path] = {}
    if any(c.model == "qwen3-30b-a3b" for c in todo):
        ckpts["qwen3-30b-a3b"] = build_checkpoint(work, layers, False)
    if any(c.model == "gpt-oss-20b" for c in todo):
        p = work / "gpt-oss-20b-24l"
        if not (p / ".complete").exists():
            print(f"writing the random gpt-oss-20b checkpoint (24 layers) to {p} ...", flush=True)
            write_checkpoint(p, "gpt-oss-20b")
            (p / ".complete").write_text("")
        ckpts["gpt-oss-20b"] = p
    ggufs: dict[tuple[str, str], Path] = {}
    for c in todo if src is not None else []:
        key = (c.model, c.gguf)
        if key in ggufs:
            continue
        ckpt = ckpts[c.model]
        bf16 = convert(src, ckpt, "bf16")  # gpt-oss: MXFP4 experts repacked as such, dense bf16
        if c.gguf in ("bf16", "mxfp4"):  # mxfp4: the converter's output, experts as shipped
            ggufs[key] = bf16
            continue
        qtype, extra = QUANT_TYPES[c.gguf]
        path = ckpt.parent / f"{ckpt.name}-{c.gguf}.gguf"
        if not path.exists():
            print(f"llama-quantize {bf16.name} -> {path.name} ...", flush=True)
            tmp = path.with_name(path.stem + ".part.gguf")  # llama-quantize keeps a .gguf name
            subprocess.run(
                [str(build_target(src, "llama-quantize")), *extra, str(bf16), str(tmp), qtype],
                check=True,
                capture_output=True,
                timeout=3600,
            )
            tmp.rename(path)
        ggufs[key] = path
    return {"ckpts": ckpts, "ggufs": ggufs}


def measure(
    src: Path | None,
    work: Path,
    todo: list[Cell],
    tokens: int,
    rounds: int,
    layers: int,
    warmup: bool,
) -> dict[str, Any]:
    """Every cell once per round (a warm-up round first, discarded, with `warmup`), engine and llama.cpp
    back to back under the same cgroup; the plan's projections right after each
    cell's last round; then the reference runs and dd."""
    from tqdm.auto import tqdm

    from bench.cgroup import MemoryCgroup

    files = build_files(src, work, layers, todo)
    ckpts, ggufs = files["ckpts"], files["ggufs"]
    quant_dir = str(work / "quant-cache")

    def trace(c: Cell) -> Path:  # the cell's decode routing (the last round's)
        return work / f"trace-{c.model}-{c.engine}-{c.limit_gib:g}.npz"

    def plan_flags(c: Cell) -> list[str]:  # the plan reads the sidecar the cells read
        quant = (
            ["--quant-cache-dir", quant_dir] if "expert_quant" in ENGINE_FIELDS[c.engine] else []
        )
        return [*PLAN_FLAGS.get(c.engine, []), *quant]

    def spec(c: Cell, **more: Any) -> dict[str, Any]:
        fields = dict(ENGINE_FIELDS[c.engine], quant_cache_dir=quant_dir, **more)
        return {"ckpt": str(ckpts[c.model]), "fields": fields, "tokens": tokens}

    groups = {
        g: MemoryCgroup(int(g * 2**30), name=f"moe-offload-btr-{os.getpid()}-{g:g}")
        for g in {c.limit_gib for c in todo}
    }
    res: dict[str, Any] = {c.name: {"engine": [], "llama": []} for c in todo}
    plans: dict[str, Any] = {}
    own: dict[str, Any] = {}

    def projections(c: Cell, ckpt: Path, cg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """`moe-offload plan`'s projection for the cell, and the same plan fed this cell's own decode
        routing (`--trace`): the projection's access pattern is then the measured one, and what
        remains is its cost model."""
        plan = plan_projection(ckpt, cg, plan_flags(c))
        try:
            mine = plan_projection(ckpt, cg, [*plan_flags(c), "--trace", str(trace(c))])
        except RuntimeError as e:  # the page says so; the measured figures stand
            mine = {"projected_tps": None, "n_slots": None, "text": str(e)}
        return plan, mine

    # engine kind -> bytes of one expert read, and the file its experts are read from (the checkpoint,
    # or the int8 sidecar), known after its first cell: dd reads the same file in the same blocks
    expert_sizes: dict[str, int] = {}
    read_files: dict[str, Path] = {}
    try:
        for rnd in tqdm(range(0 if warmup else 1, rounds + 1), desc="rounds (0 is the warm-up)"):
            for c in todo:
                cg, ckpt, gguf = groups[c.limit_gib], ckpts[c.model], ggufs.get((c.model, c.gguf))
                # The disk's O_DIRECT bandwidth right before and right after the cell (a shared disk's
                # rate moves): the share divides by their mean, and both are reported.
                block = dd_block(expert_sizes.get(c.engine))
                before = dd_direct(read_files.get(c.engine, shard(ckpt)), block, DD_BYTES)
                e = run_engine(
                    dict(spec(c), trace=str(trace(c))),
                    cg,
                    [ckpt, Path(quant_dir)] if Path(quant_dir).exists() else [ckpt],
                )
                expert_sizes[c.engine] = e["expert_bytes"]
                read_files[c.engine] = Path(e["read_file"])
                after = dd_direct(read_files[c.engine], dd_block(e["expert_bytes"]), DD_BYTES)
                e["dd_before_gb_s"], e["dd_after_gb_s"] = before, after
                e["dd_gb_s"] = (before + after) / 2
                if (
                    rnd == rounds
                ):  # the plan's projections right after the cell: the same moment's machine
                    plans[c.name], own[c.name] = projections(c, ckpt, cg)
                ll = (
                    run_llama(src, gguf, tokens, cg, measure_bytes=rnd == rounds)
                    if src is not None and gguf is not None
                    else {"decode_tps": float("nan")}
                )
                if rnd:
                    res[c.name]["engine"].append(e)
                    if src is not None:
                        res[c.name]["llama"].append(ll)
                    (work / "progress.json").write_text(
                        json.dumps(res)
                    )  # survives an interrupted run
                print(
                    f"round {rnd} {c.name}: engine {e['decode_tps']:.3f} tok/s, llama.cpp {ll['decode_tps']:.3f}",
                    flush=True,
                )
        refs = {}
        for c in todo:
            key = f"{c.model} {c.engine}"
            if key not in refs:
                refs[key] = run_engine(
                    spec(c, host_memory=REFERENCE_HOST_MEMORY), None, [ckpts[c.model]]
                )
    finally:
        for cg in groups.values():
            cg.close()
    expert = res[todo[0].name]["engine"][-1]["expert_bytes"]
    last = shard(ckpts[todo[0].model])
    dd = {
        "1MiB": dd_direct(last, 1 << 20),
        "expert": dd_direct(last, -(-expert // 4096) * 4096),
        "expert_bytes": expert,
    }
    sizes = {
        str(p.name): du(p)
        for p in [*ckpts.values(), *ggufs.values(), Path(quant_dir)]
        if p.exists()
    }
    return {
        "cells": res,
        "references": refs,
        "plans": plans,
        "plans_own_trace": own,
        "dd": dd,
        "sizes": sizes,
        "ckpt_paths": [str(p) for p in ckpts.values()],
        "gguf_paths": [str(p) for p in ggufs.values()],
    }


def shard(ckpt: Path) -> Path:
    """The checkpoint's largest safetensors file (what dd reads)."""
    return max(ckpt.glob("*.safetensors"), key=lambda p: p.stat().st_size)


def du(path: Path) -> int:
    """Bytes a file or folder takes on disk."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return sum(p.stat().st_blocks * 512 for p in files)


def summarize(m: dict[str, Any], todo: list[Cell]) -> list[dict[str, Any]]:
    """One row per cell: medians over the measured rounds and the acceptance ratios."""
    from statistics import median

    rows = []
    for c in todo:
        r = m["cells"][c.name]
        eng, ll = r["engine"], r["llama"]
        ref = m["references"][f"{c.model} {c.engine}"]
        per = [e["decode_tps"] / x["decode_tps"] for e, x in zip(eng, ll)]  # [] without llama.cpp
        e_tps = median(e["decode_tps"] for e in eng)
        bytes_tok = median(e["bytes_per_token"] for e in eng)
        min_tok = median(e["min_bytes_per_token"] for e in eng)
        read = median(e["read_gb_s"] for e in eng)
        # Each round's engine read rate over the mean of the dd runs right before and after it.
        share = median(e["read_gb_s"] / e["dd_gb_s"] for e in eng)
        dd_around = [(e.get("dd_before_gb_s"), e.get("dd_after_gb_s")) for e in eng]
        proj = m["plans"][c.name]["projected_tps"]
        own = m["plans_own_trace"][c.name]["projected_tps"]
        rows.append(
            {
                "cell": c.name,
                "engine_tps": e_tps,
                "llama_tps": median(x["decode_tps"] for x in ll) if ll else None,
                "per_round": per,
                "ratio": median(per) if per else None,
                "engine_bytes_per_token": bytes_tok,
                "llama_bytes_per_token": next(
                    (x["bytes_per_token"] for x in ll if "bytes_per_token" in x), None
                ),
                "min_bytes_per_token": min_tok,
                "bytes_over_min": bytes_tok / min_tok if min_tok else None,
                "lru_over_min": _loads_over_min(eng, "lru_loads_per_token"),
                "uniform_online_over_min": _loads_over_min(eng, "uniform_online_loads_per_token"),
                "read_gb_s": read,
                "read_share_of_dd": share,
                "dd_gb_s": median(e["dd_gb_s"] for e in eng),
                "dd_before_after_gb_s": dd_around,
                "projected_tps": proj,
                "projected_over_measured": proj / e_tps if proj else None,
                "projected_own_trace_tps": own,
                "own_trace_over_measured": own / e_tps if own else None,
                "n_slots": eng[-1]["n_slots"],
                "total_experts": eng[-1]["total_experts"],
                "tokens_equal_reference": all(e["tokens"] == ref["tokens"] for e in eng),
                "reference_n_slots": ref["n_slots"],
                "engine_peak": max(e.get("cgroup_peak") or 0 for e in eng),
                "llama_peak": max((x.get("cgroup_peak") or 0 for x in ll), default=0),
            }
        )
    return rows


def _loads_over_min(eng: list[dict[str, Any]], key: str) -> float | None:
    """The median over rounds of an online reference's loads a token over MIN's (None: not recorded)."""
    from statistics import median

    if not all(key in e and e.get("min_loads_per_token") for e in eng):
        return None
    return median(e[key] / e["min_loads_per_token"] for e in eng)


def render(rows: list[dict[str, Any]], m: dict[str, Any]) -> list[str]:
    """The markdown tables of the section."""

    def gb(x: float | None) -> str:
        return "n/a" if x is None else f"{x / 1e9:.3f}"

    def times(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}×"

    lines = [
        "| cell | engine tok/s | llama.cpp mmap tok/s | engine / llama.cpp per round | median ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["llama_tps"] is None:
            lines.append(f"| {r['cell']} | {r['engine_tps']:.3f} | not run | | |")
            continue
        per = ", ".join(f"{x:.2f}" for x in r["per_round"])
        lines.append(
            f"| {r['cell']} | {r['engine_tps']:.3f} | {r['llama_tps']:.3f} | {per} | **{r['ratio']:.2f}×** |"
        )
    lines += [
        "",
        "| cell | fast tier (plan) | GB read / token: engine | Belady's MIN | engine / MIN | LRU / MIN | "
        "uniform-routing online / MIN | llama.cpp | "
        "engine disk GB/s | of dd O_DIRECT (mean of before / after it) | plan's projected tok/s | projected / measured | "
        "with the cell's own routing (--trace) | / measured | tokens = reference | peak engine / llama.cpp GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        over = "n/a" if r["bytes_over_min"] is None else f"{r['bytes_over_min']:.2f}×"
        proj = "n/a" if r["projected_tps"] is None else f"{r['projected_tps']:.3f}"
        pom = (
            "n/a"
            if r["projected_over_measured"] is None
            else f"{r['projected_over_measured']:.2f}×"
        )
        own = (
            "n/a"
            if r["own_trace_over_measured"] is None
            else f"{r['projected_own_trace_tps']:.3f} | {r['own_trace_over_measured']:.2f}×"
        )
        if r["own_trace_over_measured"] is None:
            own = "n/a | n/a"
        lines.append(
            f"| {r['cell']} | {r['n_slots']} of {r['total_experts']} | {gb(r['engine_bytes_per_token'])} | "
            f"{gb(r['min_bytes_per_token'])} | {over} | {times(r.get('lru_over_min'))} | "
            f"{times(r.get('uniform_online_over_min'))} | {gb(r['llama_bytes_per_token'])} | {r['read_gb_s']:.2f} | "
            f"{r['read_share_of_dd']:.0%} of {r['dd_gb_s']:.2f} ({dd_pairs(r)}) | {proj} | {pom} | {own} | {'yes' if r['tokens_equal_reference'] else '**no**'} | "
            f"{r['engine_peak'] / 2**30:.2f} / {r['llama_peak'] / 2**30:.2f} |"
        )
    dd = m["dd"]
    lines += [
        "",
        f"Disk: `dd iflag=direct` on a checkpoint shard reads {dd['expert']:.2f} GB/s in blocks of one expert "
        f"({dd['expert_bytes'] / 1e6:.2f} MB) and {dd['1MiB']:.2f} GB/s in blocks of 1 MiB after the rounds; "
        "the table's share divides each round's engine read rate by the mean of two 1 GiB dd runs in expert-sized blocks "
        "of the file that cell's experts are read from (the checkpoint, or the int8 sidecar; the checkpoint before a kind's first cell has run), "
        "one right before and one right after that engine cell (both in brackets, per round).",
    ]
    return lines


def dd_pairs(row: dict[str, Any]) -> str:
    """The dd rates around each round's engine cell: 'before / after' per round."""
    return ", ".join(
        "n/a" if b is None or a is None else f"{b:.2f} / {a:.2f}"
        for b, a in row.get("dd_before_after_gb_s", [])
    )


SECTION = "## c. Bigger than memory, under memory cgroups"


def run(args: argparse.Namespace, src: Path | None, work: Path, command: str) -> None:
    """The whole bigger-than-memory run: files, rounds, references, report (appended to --out as its
    own section, the numbers in OUT_bigger_than_ram.json), then the files deleted unless --keep."""
    import shutil

    from bench.cgroup import MemoryCgroup

    why = MemoryCgroup.unavailable()
    if why:
        sys.exit(f"--bigger-than-ram needs memory cgroups: {why}")
    limits = [float(x) for x in args.limits.split(",")]
    todo = cells(limits, args.oss_limit or None, tuple(args.kinds.split(",")))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    m = measure(src, work, todo, args.tokens, args.rounds, args.layers, not args.no_warmup)
    rows = summarize(m, todo)
    lines = [
        SECTION,
        "",
        f"Run started {started}: `{command}`. **Random weights** in every checkpoint (bench/real_shapes.py): "
        f"Qwen3-30B-A3B's released per-layer shape at {args.layers} of 48 layers (bf16), gpt-oss-20b's at its full "
        "24 layers with its experts MXFP4 as released (dense bf16). Each cell runs the engine and then llama.cpp "
        "in the same memory cgroup (cgroup v1 `memory.limit_in_bytes`; page cache counts against it), each from a "
        f"cold page cache for its files, {args.rounds} measured round(s)"
        + ("" if args.no_warmup else " after a warm-up round")
        + "; ratios per round, "
        "then the median. Engine: `load_model(CKPT, EngineConfig(offload='disk', dtype='bfloat16'[, "
        "expert_quant='int8']))`, no cache flag: its memory plan sizes the fast tier inside the cgroup (planned "
        f"for one sequence of {DECODE_MAX_MODEL_LEN} tokens); {args.tokens} tokens sampled at temperature 1 (seed 0) "
        f"after a {PROMPT}-token prompt. llama.cpp: `llama-bench -m GGUF -p 0 -n {args.tokens} -t 1 -r 1 -lm mmap --repack 0` "
        "(no weight repacking: it would copy MXFP4 weights into anonymous memory, which the cgroup cannot hold) "
        "(it decodes random tokens). Equal bits: bf16 experts / bf16 GGUF; int8 experts (whole-row scales) / "
        "Q8_0 experts (blocks of 32), dense bf16 in both; MXFP4 / MXFP4 (the converter repacks gpt-oss's "
        "blocks and scales as they are).",
        "",
        *render(rows, m),
        "",
        "Sizes on disk under the work folder: "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in m["sizes"].items())
        + f"; {sum(m['sizes'].values()) / 1e9:.1f} GB in all.",
    ]
    out: Path | None = args.out
    if out is not None:
        text = out.read_text() if out.exists() else ""
        rest = ""
        if SECTION in text:  # replace the section of an earlier run, keep the sections after it
            head, tail = text.split(SECTION, 1)
            nxt = tail.find("\n## ")
            text, rest = head.rstrip() + "\n", tail[nxt:] if nxt >= 0 else ""
        out.write_text(text + ("\n" if text else "") + "\n".join(lines) + "\n" + rest)
        side = out.with_name(out.stem + "_bigger_than_ram.json")
        kept = {k: v for k, v in m.items() if k not in ("ckpt_paths", "gguf_paths")}
        dump = json.dumps({"command": command, "started": started, "rows": rows, **kept}, indent=2)
        side.write_text(dump.replace(str(work), str(args.work)))  # no absolute paths
    print("\n".join(lines))
    if not args.keep:
        for p in [*m["ckpt_paths"], *m["gguf_paths"], work / "quant-cache", *work.glob("trace-*")]:
            if Path(p).is_dir():
                shutil.rmtree(p)
            elif Path(p).exists():
                Path(p).unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", required=True, help="one engine cell, as JSON (the parent's spec)")
    args = ap.parse_args()
    print(json.dumps(engine_cell(json.loads(args.cell))), flush=True)


if __name__ == "__main__":
    main()
