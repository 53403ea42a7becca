"""Decode speed against peers on one checkpoint, side by side: transformers, this engine, llama.cpp.

Systems, all on the same random qwen3_moe checkpoint (built here once; weights cannot be downloaded):
  - transformers `generate`, f32 (the reference every ratio is also given against);
  - this engine at cache 1.0 (f32, bf16, and int8 experts: whole-row weight-only, dense parts bf16; every
    expert resident) and at cache 0.25 reading experts from disk (f32, uncached I/O);
  - llama.cpp's `llama-bench` at f32, bf16 and Q8_0, the GGUF files converted from the same checkpoint with
    llama.cpp's own `convert_hf_to_gguf.py`.
Each system decodes `--tokens` greedy tokens after a short prompt; prefill is excluded everywhere (llama-bench
`-p 0 -n N`). Every cell runs at each of `--threads` (default 1 and 2) once per round; rounds are interleaved
after a warm-up round and the report gives medians and per-round ratios. On a shared machine thread scaling can
be erratic (llama-bench bf16 was once measured 25x slower at 2 threads than at 1); the report warns when a
system's 2-thread figure is not above its 1-thread one.

llama.cpp is found or built: `--llama-cpp DIR` (a llama.cpp source tree with build/bin/llama-bench), else
WORK/llama.cpp, built here from the source that the llama-cpp-python sdist on PyPI vendors:
    pip download --no-deps --no-binary :all: llama-cpp-python
    tar xzf llama_cpp_python-*.tar.gz; cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-bench -j
(about 5-15 minutes on 2 cores). Where that fails (no compiler, no network), the llama.cpp rows are skipped with
a one-line reason. The converter does not know this checkpoint's small BPE tokenizer; it is run with unknown
pre-tokenizers mapped to "gpt-2", which changes nothing about the weights or the decode speed.

    python -m bench.peers --shape mid --out docs/benchmarks/peers.md
    python -m bench.peers --shape mid --memory-limit 0.6,1.0 --tokens 32 --out docs/benchmarks/peers_memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from bench.engine_bench import hf_decode_tps
from bench.report import write_report
from engine import EngineConfig, SamplingParams, generate, load_model

# The mid-size shape of issue 15's first measurement (843M parameters there; ours has a 512-token
# vocabulary, so a few million fewer) and a tiny one where per-call overhead dominates.
SHAPES: dict[str, dict[str, int]] = {
    "mid": dict(
        num_layers=8,
        hidden=1024,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        intermediate_size=2048,
        head_dim=128,
    ),
    "tiny": dict(
        num_layers=4,
        hidden=256,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=128,
        intermediate_size=512,
        head_dim=64,
    ),
}
GGUF_TYPES = ("f32", "bf16", "q8_0")
ENGINE_CELLS: dict[str, EngineConfig] = {
    "engine cache 1.0 f32": EngineConfig(cache_fraction=1.0, dtype="float32"),
    "engine cache 1.0 bf16": EngineConfig(cache_fraction=1.0, dtype="bfloat16"),
    "engine cache 1.0 int8": EngineConfig(
        cache_fraction=1.0, dtype="bfloat16", expert_quant="int8"
    ),
    "engine cache 0.25 disk f32": EngineConfig(
        cache_fraction=0.25, offload="disk", dtype="float32"
    ),
}
# Runs the converter with unknown BPE pre-tokenizers mapped to gpt-2 (see the docstring).
# llama.cpp's converter, run with `python -c CONVERT CONVERTER MODEL_DIR ARGS...`, with an unknown BPE
# pre-tokenizer mapped to gpt-2 (CONVERT_SETUP; bench/streams_vs_llama.py adds to it before CONVERT_RUN).
CONVERT_SETUP = """
import importlib.util, pathlib, sys
conv = sys.argv[1]
sys.path.insert(0, str(pathlib.Path(conv).parent))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", conv)
mod = importlib.util.module_from_spec(spec); sys.modules["convert_hf_to_gguf"] = mod; spec.loader.exec_module(mod)
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
"""
CONVERT_RUN = """
sys.argv = [conv] + sys.argv[2:]
mod.main()
"""
CONVERT = CONVERT_SETUP + CONVERT_RUN


def checkpoint(work: Path, shape: str, dtype: torch.dtype = torch.float32) -> Path:
    """The random checkpoint of `shape`, stored in `dtype` (f32, or bf16 as released checkpoints
    are), built once under `work`."""
    from models.tiny import make_tiny_checkpoint

    path = work / (shape if dtype == torch.float32 else f"{shape}-{str(dtype)[6:]}")
    if not (path / "config.json").exists():
        print(f"building the random {shape} checkpoint in {path} ...", flush=True)
        # 512 tokens: a BPE with merges, which llama.cpp's tokenizer loader requires.
        make_tiny_checkpoint(
            path,
            "qwen3_moe",
            tokenizer_vocab=512,
            max_shard_size="2GB",
            dtype=dtype,
            **SHAPES[shape],  # type: ignore[arg-type]
        )
    return path


# -- llama.cpp -----------------------------------------------------------------------------
def find_llama_cpp(work: Path, explicit: Path | None) -> tuple[Path | None, str]:
    """A llama.cpp source tree with build/bin/llama-bench (building one if needed), or None and why not."""
    if explicit is not None:
        return (
            (explicit, "")
            if (explicit / "build/bin/llama-bench").exists()
            else (None, f"--llama-cpp {explicit}: no build/bin/llama-bench there")
        )
    found = sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found and (found[-1] / "build/bin/llama-bench").exists():
        return found[-1], ""
    if not shutil.which("cmake") or not (shutil.which("c++") or shutil.which("g++")):
        return (
            None,
            "llama.cpp skipped: building it needs cmake and a C++ compiler (apt-get install cmake g++)",
        )
    try:
        if not found:
            print("downloading the llama-cpp-python sdist (it vendors llama.cpp) ...", flush=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "llama-cpp-python",
                    "-d",
                    str(work),
                ],
                check=True,
                capture_output=True,
                timeout=600,
            )
            sdist = sorted(work.glob("llama_cpp_python-*.tar.gz"))[-1]
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            found = sorted(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        src = found[-1]
        print(f"building llama-bench in {src} (several minutes) ...", flush=True)
        subprocess.run(
            ["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"],
            cwd=src,
            check=True,
            capture_output=True,
            timeout=600,
        )
        build_target(src, "llama-bench")
        return src, ""
    except (subprocess.SubprocessError, OSError, IndexError) as e:
        return (
            None,
            f"llama.cpp skipped: could not download or build it ({type(e).__name__}); pass --llama-cpp DIR to use a built tree",
        )


def build_target(src: Path, target: str) -> Path:
    """build/bin/TARGET of the llama.cpp tree `src` (its build directory configured), built if missing,
    one compiler per CPU."""
    exe = src / "build/bin" / target
    if not exe.exists():
        print(f"building {target} in {src} ...", flush=True)
        subprocess.run(
            ["cmake", "--build", "build", "--target", target, "-j", str(os.cpu_count() or 1)],
            cwd=src,
            check=True,
            capture_output=True,
            timeout=3600,
        )
    return exe


def convert(src: Path, ckpt: Path, outtype: str) -> Path:
    out = ckpt.parent / f"{ckpt.name}-{outtype}.gguf"
    if not out.exists():
        print(f"converting {ckpt.name} to {out.name} with llama.cpp's converter ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-c",
                CONVERT,
                str(src / "convert_hf_to_gguf.py"),
                str(ckpt),
                "--outtype",
                outtype,
                "--outfile",
                str(out),
            ],
            check=True,
            capture_output=True,
            timeout=3600,
        )
    return out


def llama_bench_modes(
    src: Path, gguf: Path, tokens: int, threads: int, prompt: int = 0, modes: str = "mmap,none"
) -> dict[str, float]:
    """Decode tok/s of llama-bench (-p 0: no prompt, -n N generated tokens, one repetition) in each of
    its loading `modes`: mmap of the GGUF, and a plain read into memory (`-lm none`, what the engine's
    RAM tier does). Why both: on this machine the same mmapped f32 GGUF decoded at 25 tok/s one day and
    14 the next (its page-cache pages, not llama.cpp's code), while read into memory it ran at 27.
    Builds without `-lm` run mmap alone. With `prompt` > 0 and `tokens` 0: prompt processing tok/s
    instead (-p PROMPT -n 0)."""
    cmd = [
        str(src / "build/bin/llama-bench"),
        "-m",
        str(gguf),
        "-p",
        str(prompt),
        "-n",
        str(tokens),
        "-t",
        str(threads),
        "-r",
        "1",
        "-o",
        "json",
    ]
    try:
        res = subprocess.run(
            cmd + ["-lm", modes], check=True, capture_output=True, text=True, timeout=1800
        )
    except subprocess.CalledProcessError:
        res = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return {str(r.get("load_mode", "mmap")): float(r["avg_ts"]) for r in json.loads(res.stdout)}


def llama_bench_tps(
    src: Path, gguf: Path, tokens: int, threads: int, prompt: int = 0, modes: str = "mmap,none"
) -> float:
    """llama_bench_modes' best: the faster of the loading `modes` run."""
    return max(llama_bench_modes(src, gguf, tokens, threads, prompt, modes).values())


# -- in-process systems ------------------------------------------------------------------------
def engine_tps(om, prompt: list[int], tokens: int) -> float:
    return generate(
        om, prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    ).decode_tokens_per_s


def layer_profile(om, prompt: list[int], tokens: int) -> dict[str, float]:
    """Where a decoding layer's time goes, per token and decoder layer: time inside torch calls
    (top-level ops under torch.profiler: kernels plus dispatch), inside the native library
    (engine/native/: every ctypes call timed, its argument conversion included; the profiler does
    not see them), and the rest, which is Python (the engine's and transformers' modules, the
    router glue, the plan, the wrappers around each call); and the number of top-level torch calls.

    Two views of the Python: under the profiler ("outside", an upper bound: the profiler adds a
    microsecond or two to every torch call), and the same generate timed without the profiler less
    the profiled run's op time and its own native time ("python estimate"). Both spread the step's own
    Python (scheduler, sampling, streaming) over its layers. The layer path alone, where a decode step
    takes the fused path (engine/worker/fused_decode.py): the time inside its `step` less the native
    calls made there, per decoder layer ("python in layers"), from the run without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from engine import FusedDecode, native_kernels

    kernels = native_kernels()
    native_s = [0.0]

    class TimedLib:
        """The library with each function timed (wrappers made once, on first use)."""

        def __init__(self, lib) -> None:
            self._lib = lib

        def __getattr__(self, name: str):
            fn = getattr(self._lib, name)

            def call(*a):
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    native_s[0] += time.perf_counter() - t0

            setattr(self, name, call)
            return call

    fused = {"steps": 0, "wall": 0.0, "native": 0.0}
    real_step = FusedDecode.step

    def timed_step(self, *a):
        t0, n0 = time.perf_counter(), native_s[0]
        declined = real_step(self, *a)  # None: the fused step ran; else why it declined
        if declined is None:
            fused["steps"] += 1
            fused["wall"] += time.perf_counter() - t0
            fused["native"] += native_s[0] - n0
        return declined

    def run() -> float:
        t0 = time.perf_counter()
        generate(om, prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
        return time.perf_counter() - t0

    layers = om.config.num_hidden_layers
    per = (tokens + 1) * layers
    lib = kernels.lib if kernels is not None else None
    try:
        if kernels is not None:
            kernels.lib = TimedLib(lib)
        FusedDecode.step = timed_step
        plain = run()
        FusedDecode.step = real_step
        native_plain, native_s[0] = native_s[0], 0.0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = run()
    finally:
        FusedDecode.step = real_step
        if kernels is not None:
            kernels.lib = lib
    top = [e for e in prof.events() if e.cpu_parent is None]
    inside = sum(e.cpu_time_total for e in top) / 1e6
    return {
        "ms_outside_ops_per_layer": (wall - inside - native_s[0]) / per * 1e3,
        "ms_in_ops_per_layer": inside / per * 1e3,
        "ms_in_native_per_layer": native_s[0] / per * 1e3,
        "torch_calls_per_layer": len(top) / per,
        "ms_python_estimate_per_layer": max(0.0, plain - inside - native_plain) / per * 1e3,
        "fused_step_share": fused["steps"] / tokens,
        "ms_python_in_layers_per_layer": (fused["wall"] - fused["native"])
        / max(1, fused["steps"] * layers)
        * 1e3,
    }


def disk_profile(om, prompt: list[int], tokens: int) -> dict[str, float]:
    """Why the disk cell decodes at the speed it does, from one generate's engine counters: the misses a
    token, the megabytes they read, the read speed the loads ran at (bytes over the transfer threads'
    busy time), what those reads alone take a token at that speed, the time the compute thread waited
    for them, and the whole token."""
    om.stats.reset()
    t0 = time.perf_counter()
    generate(om, prompt, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    wall = time.perf_counter() - t0
    s = om.stats.snapshot()
    busy = sum(s["transfer_seconds"].values())
    gbs = s["bytes_moved"] / busy / 1e9 if busy else float("nan")
    mb = s["bytes_moved"] / (tokens + 1) / 1e6
    return {
        "misses_per_token": s["misses"] / (tokens + 1),
        "mb_read_per_token": mb,
        "read_gb_s": gbs,
        "ms_reading_per_token": mb / gbs if busy else float("nan"),
        "ms_waiting_per_token": s["stall_seconds"] / (tokens + 1) * 1e3,
        "ms_per_token": wall / (tokens + 1) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="mid",
        help="checkpoint shape (default mid: hidden 1024, 8 layers, 64 experts, top-8)",
    )
    ap.add_argument(
        "--tokens", type=int, default=128, help="decode tokens per measurement (default 128)"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="measured rounds after a warm-up round (default 2)"
    )
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/peers"),
        help="where checkpoints, GGUF files and llama.cpp go (default .cache/peers)",
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        help="a llama.cpp source tree with build/bin/llama-bench (default: find or build one under --work)",
    )
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    ap.add_argument(
        "--memory-limit",
        metavar="FRACTIONS",
        help="instead of the speed table: bigger-than-RAM runs under a memory cgroup capped at these fractions of the model's "
        "bf16 size, e.g. 0.6,1.0 (bench/peers_memory.py; needs root or a delegated cgroup)",
    )
    ap.add_argument(
        "--out", type=Path, help="write a markdown report here (and the numbers as JSON beside it)"
    )
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args.work, args.shape)

    src, why = (
        (None, "llama.cpp skipped (--no-llama-cpp)")
        if args.no_llama_cpp
        else find_llama_cpp(args.work, args.llama_cpp)
    )
    ggufs = {f"llama.cpp {t}": convert(src, ckpt, t) for t in GGUF_TYPES} if src is not None else {}
    if why:
        print(why, flush=True)
    if args.memory_limit:
        from bench.peers_memory import run as memory_run

        fractions = [float(f) for f in args.memory_limit.split(",")]
        memory_run(
            ckpt, src, ggufs.get("llama.cpp bf16"), fractions, args.tokens, args.rounds, args.out
        )
        return

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engines = {name: load_model(ckpt, cfg) for name, cfg in ENGINE_CELLS.items()}
    prompt = torch.randint(
        3, hf.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    cells = ["transformers f32", *engines, *ggufs]

    # llama.cpp's loading mode per GGUF and thread count: the faster one in the warm-up round, then
    # that one alone. Keeping the faster of two runs in every measured round would give llama.cpp the
    # better of two noisy samples against the engine's one.
    mode: dict[tuple[str, int], str] = {}

    def run(cell: str, t: int) -> float:
        torch.set_num_threads(t)
        if cell == "transformers f32":
            return hf_decode_tps(hf, prompt, args.tokens)
        if cell in engines:
            return engine_tps(engines[cell], prompt, args.tokens)
        if (cell, t) in mode:
            return llama_bench_tps(src, ggufs[cell], args.tokens, t, modes=mode[cell, t])
        by_mode = llama_bench_modes(src, ggufs[cell], args.tokens, t)
        mode[cell, t] = max(by_mode, key=by_mode.__getitem__)
        return by_mode[mode[cell, t]]

    from tqdm.auto import tqdm

    res: dict[tuple[str, int], list[float]] = {(c, t): [] for c in cells for t in threads}
    for rnd in tqdm(range(args.rounds + 1), desc="rounds (first is warm-up)"):
        for t in threads:
            for cell in tqdm(cells, desc=f"round {rnd}, {t} thread(s)", leave=False):
                tps = run(cell, t)
                if rnd:
                    res[(cell, t)].append(tps)
    torch.set_num_threads(threads[0])
    runs = [layer_profile(engines["engine cache 1.0 f32"], prompt, args.tokens) for _ in range(3)]
    prof = {
        k: statistics.median(r[k] for r in runs) for k in runs[0]
    }  # each figure's median of three profiles
    disk = disk_profile(engines["engine cache 0.25 disk f32"], prompt, args.tokens)
    for om in engines.values():
        om.close()
    lines = table(res, cells, threads) + [
        "",
        f"Profile of the engine at cache 1.0, f32, {threads[0]} thread(s), one generate of {args.tokens} tokens under torch.profiler "
        f"(per token and decoder layer, medians of three): {prof['ms_in_ops_per_layer']:.3f} ms inside torch calls, "
        f"{prof['ms_in_native_per_layer']:.3f} ms in the native library, {prof['ms_outside_ops_per_layer']:.3f} ms outside both "
        f"(Python, plus the profiler's own cost), {prof['torch_calls_per_layer']:.0f} top-level torch calls; Python estimated from the "
        f"same generate without the profiler: {prof['ms_python_estimate_per_layer']:.3f} ms (both include the step's own Python, "
        f"spread over its layers). The layer path alone: {prof['fused_step_share']:.0%} of the decode steps took the fused path "
        f"(one native call a layer), with {prof['ms_python_in_layers_per_layer'] * 1e3:.0f} us of Python a layer there.",
        "",
        f"The disk cell, one more generate at {threads[0]} thread(s): {disk['misses_per_token']:.1f} experts missed a token, "
        f"{disk['mb_read_per_token']:.1f} MB read a token at {disk['read_gb_s']:.2f} GB/s (the loads' own speed), so "
        f"{disk['ms_reading_per_token']:.1f} ms of reading a token; the compute thread waited {disk['ms_waiting_per_token']:.1f} ms a "
        f"token for them, of a {disk['ms_per_token']:.1f} ms token.",
    ]
    write_report(
        args.out,
        header(args, ckpt, hf, why),
        lines,
        {
            "rounds": {f"{c}|{t}": v for (c, t), v in res.items()},
            "layer_profile": prof,
            "disk_profile": disk,
        },
    )


def table(
    res: dict[tuple[str, int], list[float]], cells: list[str], threads: list[int]
) -> list[str]:
    def ratio(
        a: str, b: str, t: int
    ) -> float:  # per-round ratio, then the median: both share a round's load
        return statistics.median(x / y for x, y in zip(res[(a, t)], res[(b, t)]))

    peers = [c for c in cells if c.startswith("llama.cpp")]
    lines = [
        "| system | threads | decode tok/s (median) | × transformers f32 | × engine cache 1.0 f32 |",
        "|---|---|---|---|---|",
    ]
    for t in threads:
        for c in cells:
            lines.append(
                f"| {c} | {t} | {statistics.median(res[(c, t)]):.1f} | {ratio(c, 'transformers f32', t):.2f}× | "
                f"{ratio(c, 'engine cache 1.0 f32', t):.2f}× |"
            )
    if peers:
        pairs = [
            ("engine cache 1.0 f32", "llama.cpp f32"),
            ("engine cache 1.0 bf16", "llama.cpp bf16"),
            ("engine cache 1.0 int8", "llama.cpp q8_0"),
            ("engine cache 0.25 disk f32", "engine cache 1.0 f32"),
        ]
        lines += [
            "",
            "| ratio | " + " | ".join(f"{t} thread(s)" for t in threads) + " |",
            "|---|" + "---|" * len(threads),
        ]
        for a, b in pairs:
            lines.append(
                f"| {a} / {b} | " + " | ".join(f"{ratio(a, b, t):.2f}×" for t in threads) + " |"
            )
    if len(threads) > 1:
        lo, hi = threads[0], threads[-1]
        erratic = [
            c for c in cells if statistics.median(res[(c, hi)]) <= statistics.median(res[(c, lo)])
        ]
        if erratic:
            lines += [
                "",
                f"**Warning:** thread scaling is erratic on this shared machine: {', '.join(erratic)} "
                f"decoded no faster at {hi} threads than at {lo}. Read the {lo}-thread rows.",
            ]
    return lines


def header(args: argparse.Namespace, ckpt: Path, hf, why: str) -> str:
    n = sum(p.numel() for p in hf.parameters())
    s = SHAPES[args.shape]
    return (
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}, Python "
        f"{platform.python_version()}. Checkpoint: random qwen3_moe '{args.shape}' (hidden {s['hidden']}, {s['num_layers']} "
        f"layers, {s['num_experts']} experts, top-{s['num_experts_per_tok']}, moe_intermediate {s['moe_intermediate_size']}; "
        f"{n / 1e6:.0f}M parameters), built by the script. {args.tokens} greedy decode tokens per measurement, prefill "
        f"excluded; medians of {args.rounds} interleaved rounds after a warm-up round. llama.cpp: its mmap or "
        f"read-into-memory loading mode, whichever was faster in the warm-up round, in every measured round."
        + (f" {why}" if why else "")
    )


if __name__ == "__main__":
    main()
