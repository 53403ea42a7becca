"""What the real-shape benchmarks share: the checkpoint they build and llama-quantize's types.
bench/real_shapes_bench.py and bench/bigger_than_ram.py both use them (one module apart from both, so neither
imports the other)."""

from __future__ import annotations

from pathlib import Path

MODEL = "qwen3-30b-a3b"
DENSE_BF16 = (
    "--output-tensor-type",
    "bf16",
    "--token-embedding-type",
    "bf16",
    "--tensor-type",
    "attn=bf16",
)
QUANT_TYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "q8_0": ("Q8_0", DENSE_BF16),
    "q4_0": ("Q4_0", DENSE_BF16),
    "q8_0-mix": ("Q8_0", ()),
    "q4_0-mix": ("Q4_0", ()),
}


def build_checkpoint(work: Path, layers: int, tiny: bool) -> Path:
    """The random checkpoint, written once (a marker file says the write finished)."""
    from bench.real_shapes import TINY_WIDTHS, write_checkpoint

    path = work / f"{MODEL}-{layers}l{'-tiny' if tiny else ''}"
    if not (path / ".complete").exists():
        print(f"writing the random {MODEL} checkpoint ({layers} layers) to {path} ...", flush=True)
        write_checkpoint(path, MODEL, layers, **(TINY_WIDTHS[MODEL] if tiny else {}))
        (path / ".complete").write_text("")
    return path
