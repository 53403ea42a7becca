"""Engine settings: a frozen dataclass, loadable from configs/*.yaml and overridable by flags."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError
from engine.settings_file import YamlSection


@dataclass(frozen=True)
class EngineConfig(YamlSection):
    SECTION = "engine"

    cache_fraction: float = 1.0  # share of all routed experts that fit in the fast tier
    cache_bytes: int | None = None  # alternative to cache_fraction: fast-tier budget in bytes
    offload: str = "ram"  # slow tier: "ram" (host memory) or "disk" (checkpoint files, uncached reads)
    link: str | None = None  # emulated link in front of the slow tier: a name or "MBPS[:LATENCY_US]"
    policy: str = "fetch-all"  # miss policy or preset: fetch-all, threshold, first-choice, quality-first, speed-first
    eviction: str | None = None  # lru | frequency; None = the policy's default (presets: frequency, else lru)
    admission: str | None = None  # none | background; None = the policy's default (presets: background)
    substitute: str = "best-resident"  # what stands in for a substituted miss: best-resident | drop
    threshold: float = 0.15  # the threshold rule's gate cut-off (normalized gate weight)
    admission_beta: float = 0.5  # background admission: accumulated substituted mass that admits an expert
    frequency_decay: float = 0.999  # frequency eviction: score decay per cache access
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" (fp32 on CPU, checkpoint dtype on GPU), "float32", "bfloat16", "float16"
    transfer_workers: int = 2  # background transfer threads
    warm_start: bool = True  # fill the fast tier at load time instead of taking cold misses
    direct_io: bool = True  # disk tier: try O_DIRECT before pread + fadvise(DONTNEED)
    # Routed experts as stored, moved and cached: "none" (checkpoint weights in the compute dtype), "int8"
    # or "int4" (group-wise, dequantized on compute; engine/experts/quant.py). Quantizing happens once, into a
    # sidecar file in quant_cache_dir (default: $XDG_CACHE_HOME/moe-offload/experts), reused on the next start.
    expert_quant: str = "none"
    expert_quant_group: int = 64  # weights per quantization group (one fp16 scale, and zero for int4, each)
    quant_cache_dir: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.cache_fraction <= 1.0:
            raise ConfigError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise ConfigError(f"cache_bytes must be > 0, got {self.cache_bytes}")
        if self.offload not in ("ram", "disk"):
            raise ConfigError(f"offload must be 'ram' or 'disk', got {self.offload!r}")
        if self.expert_quant not in ("none", "int8", "int4"):
            raise ConfigError(f"expert_quant must be 'none', 'int8' or 'int4', got {self.expert_quant!r}")
        if self.expert_quant_group < 2 or self.expert_quant_group % 2:
            raise ConfigError(f"expert_quant_group must be an even number >= 2, got {self.expert_quant_group}")
        if self.transfer_workers < 1:
            raise ConfigError(f"transfer_workers must be >= 1, got {self.transfer_workers}")

    def policies(self):
        """The policy objects these settings name (fresh state each call)."""
        from policies import make_policies

        try:
            return make_policies(self.policy, self.eviction, self.admission, self.substitute,
                                 self.threshold, self.admission_beta, self.frequency_decay)
        except ValueError as e:
            raise ConfigError(str(e)) from None
