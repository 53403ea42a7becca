"""The regime CPU users have: a model bigger than RAM (`python -m bench.peers --memory-limit 0.6,1.0`).

Every system runs in a process of its own inside a memory cgroup (bench/cgroup.py) capped at a
fraction of the model's bf16 size, from a cold page cache, at 1 thread, in bf16, interleaved over
rounds after a warm-up round:
  - llama.cpp `llama-bench` on the bf16 GGUF with each load mode the build has: `mmap` (the
    default: pages are read on demand and evicted under pressure), `dio` (direct I/O into memory
    it allocates) and `none` (read into memory); a mode that cannot fit is killed by the cgroup and
    reported as such;
  - this engine, exact (fetch-all), experts on disk read with uncached I/O, on a bf16 copy of the
    checkpoint, with a fast tier sized to the limit: the limit minus the process's measured fixed
    memory (runtime, dense weights) and a margin.
It also measures, with no limit, the engine's peak RSS at cache 1.0 with `--offload ram` against
the model's bytes (issue 15 acceptance: at most the model plus 600 MiB).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.cgroup import MemoryCgroup, evict_page_cache
from bench.report import write_report

LOAD_MODES = ("mmap", "dio", "none")
MARGIN = (
    96 * 2**20
)  # headroom above the measured fixed memory: allocator slack, the KV cache, the prompt


def bf16_checkpoint(ckpt: Path) -> Path:
    """A bf16 copy of the checkpoint (built once beside it), so the engine reads 2-byte experts as llama.cpp's bf16 GGUF holds them."""
    out = ckpt.parent / f"{ckpt.name}-bf16"
    if not (out / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"writing a bf16 copy of {ckpt.name} to {out.name} ...", flush=True)
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).save_pretrained(
            out, max_shard_size="2GB"
        )
        AutoTokenizer.from_pretrained(ckpt).save_pretrained(out)
    return out


def _engine_argv(model: Path, tokens: int, config: dict) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.engine_once",
        "--model",
        str(model),
        "--tokens",
        str(tokens),
        "--threads",
        "1",
        "--config",
        json.dumps(config),
    ]


def _llama_argv(src: Path, gguf: Path, tokens: int, mode: str) -> list[str]:
    return [
        str(src / "build/bin/llama-bench"),
        "-m",
        str(gguf),
        "-p",
        "0",
        "-n",
        str(tokens),
        "-t",
        "1",
        "-r",
        "1",
        "-o",
        "json",
        "-lm",
        mode,
    ]


def _last_json(stdout: str) -> dict:
    """The JSON line a child ends its output with (bench/engine_once.py prints one)."""
    return json.loads(stdout.strip().splitlines()[-1])


def _tps(res, llama: bool) -> tuple[float | None, str]:
    """tok/s from a finished child, or None and why it failed (killed by the cgroup, or an error line)."""
    if res.returncode != 0:
        if res.returncode in (-9, 137):
            return None, "killed: out of memory in the limit"
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"failed (exit {res.returncode}): {tail[0][:120]}"
    if llama:
        return float(json.loads(res.stdout)[0]["avg_ts"]), ""
    return float(_last_json(res.stdout)["tok_s"]), ""


def run(
    ckpt: Path,
    src: Path | None,
    gguf_bf16: Path | None,
    fractions: list[float],
    tokens: int,
    rounds: int,
    out: Path | None,
) -> None:
    why = MemoryCgroup.unavailable()
    if why:
        raise SystemExit(f"peers.py --memory-limit: {why}")
    model = bf16_checkpoint(ckpt)
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    cold = [model] + ([gguf_bf16] if gguf_bf16 is not None else [])

    # The engine's fixed memory: a process holding the smallest fast tier (one layer's top-k experts).
    from engine import read_config

    cfg = read_config(model)
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    smallest = dict(
        dtype="bfloat16", offload="disk", cache_bytes=cfg.num_experts_per_tok * expert_bytes
    )
    probe = MemoryCgroup(2**62, name="moe-offload-bench-probe")
    fixed = (
        _last_json(probe.run(_engine_argv(model, 4, smallest), cold).stdout)["peak_rss_mib"] * 2**20
    )
    ram = _last_json(
        probe.run(
            _engine_argv(model, tokens, dict(dtype="bfloat16", offload="ram", cache_fraction=1.0)),
            cold,
        ).stdout
    )
    probe.close()

    systems: dict[
        tuple[float, str], list[str] | None
    ] = {}  # None: the limit leaves no room for a fast tier
    for frac in fractions:
        limit = int(frac * model_bytes)
        cache = limit - int(fixed) - MARGIN
        for mode in LOAD_MODES if src is not None and gguf_bf16 is not None else ():
            systems[(frac, f"llama.cpp bf16 -lm {mode}")] = _llama_argv(
                src, gguf_bf16, tokens, mode
            )  # type: ignore[arg-type]
        systems[(frac, "engine bf16 disk, exact")] = (
            _engine_argv(model, tokens, dict(dtype="bfloat16", offload="disk", cache_bytes=cache))
            if cache > expert_bytes * cfg.num_experts_per_tok
            else None
        )
    cells = list(systems)
    groups = {
        frac: MemoryCgroup(int(frac * model_bytes), name=f"moe-offload-bench-{int(frac * 100)}")
        for frac in fractions
    }
    res: dict[tuple[float, str], list[float | None]] = {c: [] for c in cells}
    notes: dict[tuple[float, str], str] = {}
    try:
        for rnd in tqdm(range(rounds + 1), desc="memory-limit rounds (first is warm-up)"):
            for frac, name in tqdm(cells, desc=f"round {rnd}", leave=False):
                argv = systems[(frac, name)]
                if argv is None:
                    tps, note = None, "the limit leaves no room for a fast tier"
                else:
                    tps, note = _tps(groups[frac].run(argv, cold), llama=name.startswith("llama"))
                if note:
                    notes[(frac, name)] = note
                if rnd:
                    res[(frac, name)].append(tps)
    finally:
        for g in groups.values():
            g.close()
        for f in cold:
            evict_page_cache(f)

    lines = [
        f"Model: {model.name} (bf16 safetensors, {model_bytes / 2**30:.2f} GiB; llama.cpp reads the bf16 GGUF converted from the same "
        f"checkpoint). The engine's fixed memory (peak RSS with the smallest fast tier): {fixed / 2**20:.0f} MiB.",
        "",
        "| memory limit | system | decode tok/s (median) | × llama.cpp mmap | note |",
        "|---|---|---|---|---|",
    ]
    for frac, name in cells:
        vals = [v for v in res[(frac, name)] if v is not None]
        base = res.get((frac, "llama.cpp bf16 -lm mmap"), [])
        pairs = [a / b for a, b in zip(res[(frac, name)], base) if a is not None and b]
        ratio = f"{statistics.median(pairs):.2f}×" if pairs else "–"
        lines.append(
            f"| {frac:.0%} of the model ({frac * model_bytes / 2**30:.2f} GiB) | {name} | "
            f"{statistics.median(vals) if vals else float('nan'):.2f} | {ratio} | {notes.get((frac, name), '')} |"
        )
    over = ram["peak_rss_mib"] - model_bytes / 2**20
    lines += [
        "",
        "| no limit | value |",
        "|---|---|",
        f"| engine bf16, cache 1.0, --offload ram: peak RSS | {ram['peak_rss_mib']:.0f} MiB = the model's {model_bytes / 2**20:.0f} MiB + {over:.0f} MiB |",
        f"| the same, RSS after loading | {ram['rss_after_load_mib']:.0f} MiB |",
        f"| the same, decode tok/s | {ram['tok_s']:.1f} |",
    ]
    header = (
        f"Bigger than RAM: each system in its own process inside a memory cgroup, from a cold page cache, 1 thread, "
        f"{tokens} decode tokens, medians of {rounds} interleaved rounds after a warm-up round."
    )
    write_report(
        out,
        header,
        lines,
        {
            "rounds": {f"{f}|{n}": v for (f, n), v in res.items()},
            "notes": {f"{f}|{n}": v for (f, n), v in notes.items()},
            "fixed_mib": fixed / 2**20,
            "ram_cache_1": ram,
            "model_bytes": model_bytes,
        },
    )
