"""Engine settings: a frozen dataclass, loadable from configs/*.yaml and overridable by flags.

Each field's `setting(...)` carries its command-line help, so the flags of every command are
generated from this class (engine/settings_file.py) and cannot drift from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import ConfigError
from engine.native.variants import VARIANTS
from engine.settings_file import YamlSection, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
FORWARDS = ("auto", "fused", "lean", "transformers")
# The native kernels' builds, widest first, after auto: read from engine/native/variants.py, the one
# list of builds (that module imports only the standard library, so reading it here stays cheap).
BUILDS = ("auto", *(v.name for v in VARIANTS))
_NAMED = ", ".join(BUILDS[1:-1]) + " or " + BUILDS[-1]


@dataclass(frozen=True)
class EngineConfig(YamlSection):
    SECTION = "engine"

    cache_fraction: float | None = setting(
        None,
        "share of all routed experts kept in the fast tier, in (0, 1]. Default: the memory plan's choice (every expert where they fit, else what the budget leaves)",
        metavar="F",
    )
    cache_bytes: int | None = setting(
        None, "fast-tier budget in bytes (overrides --cache-fraction)", metavar="N"
    )
    offload: str = setting(
        "auto",
        "slow tier: 'ram' keeps all experts in host memory; 'disk' reads them from the checkpoint with uncached I/O; 'auto' (default): ram where every expert fits the host budget, else disk",
        choices=("auto", "ram", "disk"),
    )
    # The memory plan (engine/memory/planner.py) sizes what the flags above leave open to these budgets.
    device_memory: str | None = setting(
        None,
        "GPU memory the engine may use: BYTES (24GiB, 512MiB, 2000000000) or a FRACTION of the free memory (0.9, 90%%). Default: all free memory (torch.cuda.mem_get_info) less a stated headroom",
        metavar="BYTES|FRACTION",
    )
    host_memory: str | None = setting(
        None,
        "host RAM the engine may use: BYTES or a FRACTION of what is available (the smaller of MemAvailable and the memory cgroup's limit less its working set). Default: all of it less a stated headroom",
        metavar="BYTES|FRACTION",
    )
    kv_tokens: int | None = setting(
        None,
        "KV-cache tokens the memory plan reserves, summed over sequences (default: --max-model-len x --max-running; where open, min(context, 8192) tokens x 4 sequences)",
        metavar="N",
    )
    link: str | None = setting(
        None,
        "emulate a slower link in front of the slow tier: a name (pcie4, pcie3, nvme, sata-ssd, ufs, usb3, sdcard, hdd) or bandwidth in MB/s with optional latency in µs, e.g. 200:500",
        metavar="NAME|MBPS[:US]",
    )
    # A fault-injection hook of the slow tier, for soaks and tests (engine/experts/tiers/read_faults.py).
    expert_read_faults: str | None = setting(
        None,
        "inject faults into the slow tier's expert reads, for soaks and tests: a comma-separated list of eio (the read fails with EIO: the requests that needed the expert get an expert_read_failed error), short (the read returns part of the bytes; the rest is read again) or delay (the read waits secs=S seconds, default 2), each with when it fires: :p=F (probability per read), :every=N (every Nth read) or :period=S (once every S seconds), optionally :after=N and :seed=N; e.g. eio:every=50,delay:period=30:secs=3. Default: none",
        metavar="SPEC",
    )
    policy: str = setting(
        "fetch-all",
        "miss policy: fetch-all (default; waits for every missing expert, exact), threshold (wait for the first choice or a normalized gate >= --threshold, substitute the rest), first-choice (wait only for the first choice), threshold-noprotect (threshold without first-choice protection, a contrast baseline), or a preset: quality-first (threshold + frequency eviction + background admission) or speed-first (first-choice + the same)",
        metavar="NAME",
    )
    eviction: str | None = setting(
        None,
        "eviction policy: lru, frequency (decayed LFU), utility (lowest speculative utility level first, then by reuse distance) or reuse (the expert whose next use is predicted farthest away, from the layer order and an average of its use; the best with many concurrent streams). Default: frequency for the presets, else reuse",
        metavar="NAME",
    )
    admission: str | None = setting(
        None,
        "admission policy: none, or background (load an expert asynchronously once its substituted gate mass adds up to --admission-beta). Default: background for the presets, else none",
        metavar="NAME",
    )
    substitute: str = setting(
        "best-resident",
        "what stands in for a substituted miss: best-resident (default; the resident expert the router ranks highest, by logit or by sigmoid + bias for DeepSeek-V3-style routers, takes its gate weight) or drop (renormalize the remaining gates)",
        metavar="NAME",
    )
    threshold: float = setting(
        0.15, "gate cut-off of the threshold rule (default 0.15)", metavar="G"
    )
    admission_beta: float = setting(
        0.5, "substituted gate mass that triggers background admission (default 0.5)", metavar="B"
    )
    frequency_decay: float = setting(
        0.999, "frequency eviction: score decay per cache access (default 0.999)", metavar="D"
    )
    prefetch: str = setting(
        "auto",
        "prefetch: auto (default: adapter when the model directory holds a SpecPrefetch adapter, prefetcher.safetensors, made for this checkpoint, the fast tier holds fewer than all routed experts, and the miss policy substitutes or the device is a GPU; otherwise none); none; utility (MoE-SpAc: queue the experts whose speculative utility level is high, from the verification windows; cancel stale ones); adapter (SpecPrefetch: a learned adapter predicts layer l+1's experts while layer l runs; needs --prefetcher or prefetcher.safetensors beside the model); or both, adapter,utility. Predictions only start transfers: output is unchanged",
        metavar="KINDS",
    )
    prefetcher: str | None = setting(
        None,
        "SpecPrefetch adapter file for --prefetch adapter (default: prefetcher.safetensors in the model directory; train one with `moe-offload train-prefetcher`)",
        metavar="FILE",
    )
    cpu_experts: str = setting(
        "off",
        "CPU-run experts: off (default), auto (a missed expert may be computed by CPU workers straight from the host tier; the workload balancer picks which, minimising each layer's makespan), or all (every miss runs on the CPU; a diagnostic)",
        choices=("off", "auto", "all"),
    )
    cpu_workers: int = setting(2, "CPU worker threads for --cpu-experts (default 2)", metavar="N")
    balancer_level: int | None = setting(
        None,
        "with --cpu-experts auto: the workload balancer's cut. Default: the makespan-optimal one from the measured costs. N: a fixed threshold instead, every missed expert whose utility level is >= N (0-3) goes to the fast device, the rest to the CPU (the seed's fixed-threshold ablation; bench/seed_004.py)",
        metavar="N",
    )
    settle_background: bool = setting(
        False,
        "deterministic residency: before each MoE layer plans, wait until every background load (admission, prefetch) has landed, so what is resident depends on the tokens, never on transfer timing. `eval` turns it on (--async to compare); serving leaves it off",
        flag="--settle-background",
    )
    resident_lane: bool = setting(
        True,
        "the resident lane: a step whose every routed expert is resident for good skips the executor's per-layer plan (leases, scheduling, hit and miss bookkeeping). On by default; --no-resident-lane sends every step through the plan, as with a partial fast tier (the same tokens and counters, slower: a diagnostic)",
        flag="--no-resident-lane",
    )
    device: str = setting(
        "auto", "compute device: auto (default), cpu, cuda, cuda:N", metavar="DEV"
    )
    dtype: str = setting(
        "auto",
        "compute dtype: auto (default: the checkpoint's own dtype, from config.json, on CPU as on GPU), float32 (the exact reference the parity tests use), bfloat16 or float16",
        choices=DTYPES,
    )
    transfer_workers: int = setting(2, "background transfer threads (default 2)", metavar="N")
    warm_start: bool = setting(
        True, "start with an empty fast tier instead of filling it at load time", flag="--no-warm"
    )
    huge_pages: bool = setting(
        True,
        "keep the dense weights and the experts' host slots in 4 KiB pages. By default they are in transparent huge pages (2 MiB, madvise) where Linux offers them, so a decode step's weight stream misses the TLB less (docs/benchmarks/engine.md); the tokens are the same either way (a diagnostic)",
        flag="--no-huge-pages",
    )
    bf16_expert_slots: bool = setting(
        True,
        "with --dtype float32 and a checkpoint whose routed experts are bf16 (every released one), widen the experts to f32 at load, twice the bytes in every tier. By default their slots keep the checkpoint's bf16 and the kernels widen each weight as they read it: every bf16 value is exactly an f32 value, so the products are those of f32 weights (a diagnostic)",
        flag="--no-bf16-expert-slots",
    )
    bf16_dense: bool = setting(
        True,
        "with --dtype float32, widen dense linear weights (attention projections, dense and shared-expert MLPs, lm_head) that are bf16 values to f32, twice their bytes. By default, with the native kernels on the CPU, they stay bf16 and are widened as they are read, exactly as the experts are (--no-bf16-expert-slots); a diagnostic",
        flag="--no-bf16-dense",
    )
    embedding_on_disk: bool = setting(
        True,
        "copy the input embedding table into RAM. By default, on the CPU, an untied table stored in the compute dtype stays in the checkpoint and each step reads its tokens' rows (one row a decode token, through the page cache, the last 16 MiB of rows kept): the memory plan gives the table's bytes to the fast tier (a diagnostic)",
        flag="--embedding-in-ram",
    )
    direct_io: bool = setting(
        True,
        "disk tier: skip O_DIRECT and read with pread + fadvise(DONTNEED) only",
        flag="--no-direct-io",
    )
    # Routed experts as stored, moved and cached: quantizing happens once, into a sidecar file in
    # quant_cache_dir, reused on the next start (engine/experts/formats/quant.py documents the formats).
    expert_quant: str = setting(
        "none",
        "routed experts as stored, moved and cached: none (checkpoint weights in the compute dtype), int8 or int4 (group-wise round-to-nearest, dequantized on compute)",
        choices=("none", "int8", "int4"),
    )
    expert_quant_group: int | None = setting(
        None,
        "weights per quantization group, each with one fp16 scale (and zero point for int4); 0: whole rows, one scale per output channel, which with int8 and --dtype bfloat16 multiplies the int8 weights directly on CPU (the native VNNI kernel, else torch's weight-only int8 matmul) instead of dequantizing. Default: 0 for int8 (the same perplexity as groups of 64 on the embedded model, docs/benchmarks/peers.md), 64 for int4",
        metavar="N",
    )
    # Dense weights (attention projections, dense and shared-expert MLPs, lm_head) quantized at load
    # (engine/native/quant_linear.py): a file's bytes then match a stock GGUF Q8_0 mix.
    dense_quant: str = setting(
        "none",
        "dense weights (attention projections, dense and shared-expert MLPs, lm_head): none (checkpoint weights in the compute dtype) or int8 (per output channel, one fp16 scale, round-to-nearest at load; multiplied as int8 by the native kernels)",
        choices=("none", "int8"),
    )
    # The paths a step may take (engine/plan/execution.py resolves them once, in the load plan, logged at start).
    forward: str = setting(
        "auto",
        "model forward: auto (default: the fastest this model and device allow), fused (one native call per decoder layer for decode steps whose experts are all resident, else lean), lean (the same sublayers without transformers' wrappers, layer by layer), or transformers (transformers' own forward). Every path computes the same tokens; `generate --json` and /metrics count the steps each took",
        choices=FORWARDS,
    )
    native_kernels: str = setting(
        "auto",
        "the engine's C kernels on the CPU (built with gcc on first use): auto (default: on where a build compiles; each row computes the same bits whatever shares its step, and the plan shows their speed beside torch's at this model's shapes), on (the same, but fail at start without a compiler) or off (torch's kernels: another numeric family, whose rows round by what shares their step). One choice per engine: two engines in one process each run their own",
        choices=("auto", "on", "off"),
    )
    native_build: str = setting(
        "auto",
        "which build of the native kernels runs: auto (default: the widest this CPU runs, never chosen by timing, since each build computes its own bits), or one by name: "
        f"{_NAMED} (fails at start where the CPU lacks its instructions)",
        choices=BUILDS,
    )
    native_build_limit: str = setting(
        "auto",
        f"the widest build --native-build auto may choose: auto (default: every build this CPU runs), or {_NAMED}: "
        "that build and the narrower ones only (to see on a wide CPU what a narrower one would run, as bench/cpu_paths.py --emulate avx2 does, or to keep AVX-512 off on a CPU that lowers its clock for it)",
        choices=BUILDS,
    )
    decode_attention: str = setting(
        "auto",
        "attention of every row: auto (default: native, each row attending in one order whatever shares its step: batch-invariant), native (the same, fail at start without the native kernels) or sdpa (torch's scaled_dot_product_attention for decode rows, not batch-invariant)",
        choices=("auto", "native", "sdpa"),
    )
    prefix_cache_bytes: int = setting(
        256 * 1024 * 1024,
        "prompt (prefix) cache: a later request starting with the same tokens (an agent's system prompt, tools and history) skips their prefill; 0 turns it off. On the CPU, where the KV lives in one paged pool, whole blocks are shared by reference and kept in the pool's unused blocks (least recently used evicted first) and this only switches it; elsewhere it bounds the bytes of copied prompt blocks. Hybrid linear-attention (qwen3_next, qwen3_5_moe) and sliding-window models, whose recurrent state or window cannot be cut into blocks, keep whole-conversation snapshots instead (the cache at each prompt's end and at each request's end; a later request that extends one prefills only the rest), bounded by the same bytes (default 256 MiB)",
        metavar="N",
    )
    kv_borrow_share: float = setting(
        0.5,
        "share of the experts' fast-tier slots the KV pool may borrow under load, in [0, 1]: with more sessions than the planned KV holds, the least useful experts' slots become KV blocks (never below one token's top-k), and go back when idle. Applies on the CPU with the paged KV pool and a fast tier smaller than every expert; 0 keeps the split fixed (default 0.5)",
        metavar="F",
    )
    route_log: str | None = setting(
        None,
        "write the experts each MoE layer calls, one line a layer and step, to this file (engine/experts/route_log.py), for offline replay such as Belady's MIN in `bench serve`; the tokens are the same (a diagnostic)",
        metavar="FILE",
    )
    quant_cache_dir: str | None = setting(
        None,
        "where quantized experts are cached between starts (default: $XDG_CACHE_HOME/moe-offload/experts)",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        # Everything that can be checked without a model is checked here, so every front end
        # (serve before it listens, generate, eval) fails with one line before any work.
        # The checks run in this order, so of several bad settings the first named fails.
        _check_memory(self)
        _check_quant(self)
        _check_kv_sharing(self)
        _check_background(self)
        _check_compute(self)
        _check_policy_numbers(self)
        _check_specs(self)
        self.policies()

    @property
    def prefetch_kinds(self) -> set[str]:
        """The prefetchers --prefetch names (empty for none; for auto, the load plan decides: engine/plan/prefetch.py
        `prefetch_kinds`)."""
        return (
            set()
            if self.prefetch in ("none", "auto")
            else {k.strip() for k in self.prefetch.split(",") if k.strip()}
        )

    def quant_group(self) -> int:
        """Weights per quantization group for --expert-quant (0: whole rows), with the default resolved."""
        if self.expert_quant_group is not None:
            return self.expert_quant_group
        return 0 if self.expert_quant == "int8" else 64

    def policies(self):
        """The policy objects these settings name (fresh state each call)."""
        from policies import make_policies

        try:
            return make_policies(
                self.policy,
                self.eviction,
                self.admission,
                substitute=self.substitute,
                threshold=self.threshold,
                beta=self.admission_beta,
                decay=self.frequency_decay,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_memory(cfg: EngineConfig) -> None:
    """The fast tier's size, the slow tier, the memory budgets and the KV reservation."""
    if cfg.cache_fraction is not None and not 0.0 < cfg.cache_fraction <= 1.0:
        raise ConfigError(f"cache_fraction must be in (0, 1], got {cfg.cache_fraction}")
    if cfg.cache_bytes is not None and cfg.cache_bytes <= 0:
        raise ConfigError(f"cache_bytes must be > 0, got {cfg.cache_bytes}")
    if cfg.offload not in ("auto", "ram", "disk"):
        raise ConfigError(f"offload must be 'auto', 'ram' or 'disk', got {cfg.offload!r}")
    from engine.budget import parse_budget

    for flag, value in (
        ("--device-memory", cfg.device_memory),
        ("--host-memory", cfg.host_memory),
    ):
        if value is not None:
            parse_budget(str(value), flag)
    if cfg.kv_tokens is not None and cfg.kv_tokens < 0:
        raise ConfigError(f"kv_tokens must be >= 0, got {cfg.kv_tokens}")


def _check_quant(cfg: EngineConfig) -> None:
    """The routed experts' and the dense weights' quantization."""
    if cfg.expert_quant not in ("none", "int8", "int4"):
        raise ConfigError(
            f"expert_quant must be 'none', 'int8' or 'int4', got {cfg.expert_quant!r}"
        )
    if cfg.dense_quant not in ("none", "int8"):
        raise ConfigError(f"dense_quant must be 'none' or 'int8', got {cfg.dense_quant!r}")
    if cfg.expert_quant_group not in (None, 0) and (
        cfg.expert_quant_group < 2 or cfg.expert_quant_group % 2
    ):
        raise ConfigError(
            f"expert_quant_group must be 0 (whole rows) or an even number >= 2, got {cfg.expert_quant_group}"
        )


def _check_kv_sharing(cfg: EngineConfig) -> None:
    """What the KV pool may borrow from the fast tier, and the prefix cache's bytes."""
    if not 0.0 <= cfg.kv_borrow_share <= 1.0:
        raise ConfigError(f"kv_borrow_share must be in [0, 1], got {cfg.kv_borrow_share}")
    if cfg.prefix_cache_bytes < 0:
        raise ConfigError(f"prefix_cache_bytes must be >= 0, got {cfg.prefix_cache_bytes}")


def _check_background(cfg: EngineConfig) -> None:
    """The transfer threads, the CPU-run experts (workers, balancer) and the prefetchers."""
    if cfg.transfer_workers < 1:
        raise ConfigError(f"transfer_workers must be >= 1, got {cfg.transfer_workers}")
    if cfg.cpu_workers < 1:
        raise ConfigError(f"cpu_workers must be >= 1, got {cfg.cpu_workers}")
    if cfg.balancer_level is not None and not 0 <= cfg.balancer_level <= 3:
        raise ConfigError(f"balancer_level must be 0-3, got {cfg.balancer_level}")
    kinds = cfg.prefetch_kinds
    if cfg.prefetch != "auto" and (
        not kinds <= {"utility", "adapter"} or (cfg.prefetch != "none" and not kinds)
    ):
        raise ConfigError(
            f"prefetch must be auto, none, utility, adapter or adapter,utility; got {cfg.prefetch!r}"
        )
    if cfg.cpu_experts not in ("off", "auto", "all"):
        raise ConfigError(f"cpu_experts must be 'off', 'auto' or 'all', got {cfg.cpu_experts!r}")


def _check_compute(cfg: EngineConfig) -> None:
    """The forward path, the native kernels and their build, attention, the dtype and the device."""
    for name, allowed in (
        ("forward", FORWARDS),
        ("native_kernels", ("auto", "on", "off")),
        ("native_build", BUILDS),
        ("native_build_limit", BUILDS),
        ("decode_attention", ("auto", "native", "sdpa")),
    ):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}"
            )
    if "auto" not in (cfg.native_build, cfg.native_build_limit) and BUILDS.index(
        cfg.native_build
    ) < BUILDS.index(cfg.native_build_limit):
        raise ConfigError(
            f"--native-build {cfg.native_build} is wider than --native-build-limit {cfg.native_build_limit}; drop one of them"
        )
    if cfg.native_kernels == "off" and (cfg.forward == "fused" or cfg.decode_attention == "native"):
        raise ConfigError(
            "--forward fused and --decode-attention native need the native kernels; drop --native-kernels off"
        )
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {cfg.dtype!r}; use {', '.join(DTYPES)}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"bad device {cfg.device!r}; use auto, cpu, cuda or cuda:N")


def _check_policy_numbers(cfg: EngineConfig) -> None:
    """The miss policy's cut-off, the admission trigger and the frequency decay."""
    if (
        not 0.0 <= cfg.threshold <= 1.0
        or cfg.admission_beta <= 0
        or not 0.0 < cfg.frequency_decay <= 1.0
    ):
        raise ConfigError(
            "threshold must be in [0, 1], admission_beta > 0 and frequency_decay in (0, 1]"
        )


def _check_specs(cfg: EngineConfig) -> None:
    """The emulated link and the injected read faults: each spec parses (or raises ConfigError)."""
    if cfg.link:
        from engine.link_spec import parse_link

        parse_link(cfg.link)
    if cfg.expert_read_faults is not None:
        from engine.read_fault_spec import parse_read_faults

        parse_read_faults(cfg.expert_read_faults)
