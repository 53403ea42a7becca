"""Every benchmark of bench/, by name: what `python -m bench --list` prints and `python -m bench NAME`
runs (bench/__main__.py). A benchmark is a module of bench/ with a `main()` that parses its own
arguments (`python -m bench.MODULE` keeps working), or a shell script of bench/ for a GPU machine.

The pieces they share: bench/report.py (the Markdown + JSON writer `write_report`, the machine line,
the common flags `add_common_flags` / `add_run_flags`, interleaved rounds) and bench/serve_process.py
(the one launcher of a real `moe-offload serve`). tests/test_bench_cli.py checks that every script
of bench/ is registered here and that every benchmark's --help runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    target: str  # a module of bench/ (its main() runs it) or a shell script under bench/ ("x.sh")
    summary: str  # one line for --list
    pages: tuple[str, ...] = ()  # the docs/benchmarks/ pages it writes

    @property
    def is_script(self) -> bool:
        return self.target.endswith(".sh")


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "engine",
        "engine_bench",
        "decode tok/s of the engine at several cache fractions against transformers (random qwen3_moe)",
        ("engine.md",),
    ),
    Benchmark(
        "peers",
        "peers",
        "decode tok/s against transformers and llama.cpp on one checkpoint; --memory-limit: bigger than RAM",
        ("peers.md", "peers_tiny.md", "peers_memory.md"),
    ),
    Benchmark(
        "real-shapes",
        "real_shapes_bench",
        "the engine beside llama.cpp on the Qwen3-30B-A3B layer shape: decode at equal bits, prefill",
        ("real_shapes.md",),
    ),
    Benchmark(
        "real-checkpoint",
        "real_shapes",
        "write a random-weight checkpoint with a released model's config (Qwen3-30B-A3B, gpt-oss, ...)",
        ("memory_plan.md",),
    ),
    Benchmark(
        "bigger-than-ram",
        "bigger_than_ram",
        "the bigger-than-memory cells under memory cgroups (real-shapes --bigger-than-ram runs them)",
    ),
    Benchmark(
        "exactness",
        "exactness",
        "exact under load: MoE-SpAc runs, batched CPU experts, chunked prompts, a memory cgroup, bitwise",
        ("exactness.md",),
    ),
    Benchmark(
        "prefill-vs-llama",
        "prefill_vs_llama",
        "prompt processing tok/s beside llama-bench at equal bits (f32, bf16, int8/Q8_0), 512 and 4096 tokens",
        ("prefill.md",),
    ),
    Benchmark(
        "eviction-replay",
        "eviction_replay",
        "one recorded decode's routing through each eviction policy, beside Belady's MIN",
    ),
    Benchmark(
        "kernels",
        "kernel_bench",
        "effective weight bandwidth of each decode kernel against this machine's memory bandwidth",
        ("kernels.md",),
    ),
    Benchmark(
        "dense-quant",
        "dense_quant_bench",
        "real-shape decode: int4 experts vs llama.cpp Q4_0, int8 experts + --dense-quant int8 vs stock Q8_0",
    ),
    Benchmark(
        "huge-pages",
        "huge_pages_ab",
        "decode tok/s with the weights in transparent huge pages against 4 KiB pages, side by side",
        ("engine.md",),
    ),
    Benchmark(
        "int4-gemv-builds",
        "int4_gemv_builds",
        "int4 against int8 one-row gemv per native build at Qwen3-30B-A3B's expert shapes",
    ),
    Benchmark(
        "mxfp4-experts",
        "mxfp4_experts",
        "gpt-oss-20b's MXFP4 experts per native build against the torch path (dequantize, then matmul)",
    ),
    Benchmark(
        "streams-vs-llama",
        "streams_vs_llama",
        "1 and 8 concurrent streams at cache 1.0 beside llama-server -np 1 / -np 8 on the model's bf16 GGUF",
        ("peers_streams.md",),
    ),
    Benchmark(
        "concurrency",
        "concurrency_bench",
        "aggregate decode throughput against the number of concurrent streams",
        ("concurrency.md",),
    ),
    Benchmark(
        "default-path",
        "default_path",
        "generate's defaults against each fixed speculation setting: is the default the fastest?",
        ("default_path.md",),
    ),
    Benchmark(
        "policies",
        "policy_bench",
        "decode tok/s per miss policy against fetch-all, from disk and behind an emulated link",
        ("policies.md", "policies_speed.md"),
    ),
    Benchmark(
        "prefetch",
        "prefetch_bench",
        "SpecPrefetch: how well each predictor guesses the next layer's experts, and decode speed",
        ("prefetch.md",),
    ),
    Benchmark(
        "prefetch-bound",
        "prefetch_bound",
        "how predictable layer l+1's routing is from layer l at all: bounds for the adapter",
        ("prefetch_bound.md",),
    ),
    Benchmark(
        "prefix-cache",
        "prefix_cache_bench",
        "an agent-style conversation against two real servers, with and without the prefix cache",
        ("prefix_cache.md",),
    ),
    Benchmark(
        "kv-sharing",
        "kv_sharing",
        "sessions sharing a long prefix: the paged KV pool's blocks against one session's, and a returning "
        "turn's TTFT",
        ("kv_sharing.md",),
    ),
    Benchmark(
        "kv-pressure",
        "kv_pressure",
        "more concurrent long prompts than the KV pool holds, under a memory cgroup: completions, "
        "preemptions, bitwise equal to alone",
        ("kv_pressure.md",),
    ),
    Benchmark(
        "memory-split",
        "memory_split",
        "KV and experts share one budget: the split moving under many sessions on serve (/metrics), "
        "and back when idle; bitwise equal to a fixed split",
        ("memory_split.md",),
    ),
    Benchmark(
        "quant",
        "quant_bench",
        "quantized experts on the embedded model: perplexity, bytes and decode speed",
        ("quantized.md",),
    ),
    Benchmark(
        "spec",
        "spec_bench",
        "speculative decoding on the embedded pair against plain decoding",
        ("speculative.md",),
    ),
    Benchmark(
        "spac",
        "spac_bench",
        "MoE-SpAc: speculation as a sensor for prefetch, eviction and CPU-run experts",
        ("spac.md",),
    ),
    Benchmark(
        "sim-validation",
        "sim_validation",
        "the simulator's predicted speed-ups against the engine's measured ones, and projections",
        ("simulator.md",),
    ),
    Benchmark(
        "sim-plots",
        "sim_plots",
        "plot simulator.json: simulated against measured speed-up, projected tok/s per profile",
    ),
    Benchmark(
        "measure-hardware",
        "measure_hardware",
        "measure this machine's hardware profile for the simulator (configs/hardware/)",
    ),
    Benchmark(
        "revision-ab",
        "revision_ab",
        "decode speed of this checkout against another git revision, side by side",
    ),
    Benchmark(
        "fuzz-release",
        "fuzz_release",
        "release check: Schemathesis over a whole server; 5xx answers, leaks, engine restarts",
    ),
    Benchmark(
        "soak",
        "soak",
        "one server under mixed SDK traffic with engine SIGKILLs and a SIGTERM drain; lost requests",
        ("soak.md",),
    ),
    Benchmark(
        "restart-time",
        "restart_time",
        "seconds a server stops serving after an engine SIGKILL, spawned vs forked engines; an engine start's phases",
        ("soak.md",),
    ),
    Benchmark(
        "engine-once",
        "engine_once",
        "one engine decode in a process of its own (tok/s, peak RSS): the child of peers --memory-limit",
    ),
    Benchmark(
        "serve",
        "serve",
        "serving benchmark against OpenAI-compatible URLs: arrival rates, chat and agent workloads, "
        "TTFT/TPOT/ITL percentiles, goodput; this engine beside llama-server -np N",
        ("serve.md",),
    ),
    Benchmark(
        "gpu-check",
        "gpu_check",
        "on a CUDA machine: H2D bandwidth, copy/compute overlap, decode against transformers",
        ("gpu_check.md",),
    ),
    Benchmark(
        "gpu-profile",
        "gpu_profile",
        "on a CUDA machine: where a decode token's time goes, transformers against the engine",
        ("gpu_profile.md",),
    ),
    Benchmark(
        "gpu-real",
        "gpu_real.sh",
        "on one GPU, under 8 minutes: the CUDA tests, then every issue-40 target at the Qwen3-30B-A3B shape "
        "(--dry-run: the same on a CPU at toy sizes)",
    ),
    Benchmark(
        "gpu-real-driver",
        "gpu_real",
        "the driver of gpu-real: builds the checkpoints and measures the cells (gpu_real.sh runs it)",
    ),
    Benchmark(
        "cpu-paths",
        "cpu_paths",
        "is the default the fastest path on this CPU? every --forward / --native-kernels / --native-build "
        "choice against transformers (--stored bf16: a bf16 checkpoint computed in f32)",
        ("cpu_paths.md", "cpu_paths_avx512.md", "cpu_paths_bf16.md"),
    ),
    Benchmark(
        "gpu-check-all",
        "gpu_check.sh",
        "on a CUDA machine, under 5 minutes: the CUDA tests, gpu-check, spac over PCIe, gpu-profile",
        ("gpu_check.md", "gpu_spac.md", "gpu_profile.md"),
    ),
    Benchmark(
        "seed-000",
        "seed_000",
        "seed 000's tables and ablations on the embedded model: docs/seeds/000-substitution.md",
    ),
    Benchmark(
        "seed-003",
        "seed_003",
        "seed 003's (SpecPrefetch) tables on the embedded pair: docs/seeds/003-specprefetch.md",
    ),
    Benchmark(
        "seed-004",
        "seed_004",
        "seed 004's tables and ablations (MoE-SpAc) on the embedded pair: docs/seeds/004-spac.md",
    ),
    Benchmark(
        "spac-gpu",
        "spac_gpu.sh",
        "on a CUDA machine: spac with the host-memory tier over the real PCIe link",
    ),
)


def find(name: str) -> Benchmark | None:
    return next((b for b in BENCHMARKS if b.name == name), None)
