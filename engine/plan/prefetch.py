"""--prefetch resolved for a load plan: which prefetchers run (engine/worker/spac_setup.py attaches them)."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig


def prefetch_kinds(
    cfg: EngineConfig, model_dir: Path, partial: bool, moe_layers: int, pays: bool
) -> set[str]:
    """The prefetchers to run. --prefetch auto turns on SpecPrefetch's adapter where it has something to do and pays
    for itself: the fast tier misses experts (partial), the model has a layer l+1 to predict, an adapter file is
    there, and either the miss policy substitutes (an expert that landed in time is not substituted: quality-first's
    ΔPPL on the embedded model falls about threefold) or the experts compute on a GPU (where the adapter's matmul
    and the copies do not take the decode's CPU cores). On a CPU with an exact policy it measured 0.89-0.96x on
    disk, so it stays off there (docs/benchmarks/policies.md section 1b). Predictions only start transfers."""
    if cfg.prefetch != "auto":
        return cfg.prefetch_kinds
    return (
        {"adapter"}
        if partial and pays and moe_layers >= 2 and adapter_file(cfg, model_dir).is_file()
        else set()
    )


def adapter_file(cfg: EngineConfig, model_dir: Path) -> Path:
    """The SpecPrefetch adapter file: --prefetcher, or prefetcher.safetensors beside the model."""
    from engine.prefetch.adapter import FILE_NAME

    return Path(cfg.prefetcher) if cfg.prefetcher else model_dir / FILE_NAME
