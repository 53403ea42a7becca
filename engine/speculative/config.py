"""Speculative-decoding settings; their flags are generated from the fields (see engine/settings_file.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError
from engine.settings_file import YamlSection, setting

MODES = ("auto", "draft", "ngram", "off")


@dataclass(frozen=True)
class SpecConfig(YamlSection):
    SECTION = "speculative"

    speculative: str = setting(
        "auto",
        "speculative decoding: draft (a small draft model proposes), ngram (prompt lookup, no model), off, or auto (default: draft on a GPU when a draft model is given or found beside the model; off on a CPU, where a verification window of an MoE costs about as much as its rows decoded one by one, and off without a draft)",
        choices=MODES,
    )
    draft: str | None = setting(
        None,
        "draft model directory (a dense qwen3/qwen2/llama/mistral sharing the target's tokenizer). Default: a `draft` directory beside the model directory, if any",
        metavar="DIR",
    )
    num_speculative_tokens: int = setting(
        4, "proposed tokens per verification window, k (default 4)", metavar="K"
    )
    adaptive: bool = setting(
        True,
        "use a fixed k instead of adapting it per request to recent acceptance (adaptive k goes down to 0: plain decoding when speculation does not pay)",
        flag="--no-adaptive-k",
    )
    ngram_max: int = setting(
        3,
        "n-gram proposer: longest suffix matched in the request's own tokens (default 3)",
        metavar="N",
    )

    def __post_init__(self) -> None:
        if self.speculative not in MODES:
            raise ConfigError(
                f"speculative must be one of {', '.join(MODES)}, got {self.speculative!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if self.ngram_max < 1:
            raise ConfigError(f"ngram_max must be >= 1, got {self.ngram_max}")
        if self.draft is not None and not (Path(self.draft) / "config.json").exists():
            raise ConfigError(
                f"{self.draft}: not a model directory (no config.json); pass --draft with a draft model"
            )

    def resolve(self, model_dir: str | Path, device: str = "cpu") -> SpecConfig:
        """The settings with the mode and the draft picked (see `choose`)."""
        return self.choose(model_dir, device)[0]

    def choose(self, model_dir: str | Path, device: str = "cpu") -> tuple[SpecConfig, str]:
        """(the settings with the mode and the draft picked, why that mode). `auto` uses a draft given
        with --draft or found as a sibling `draft/` directory of the model (the embedded pair's layout),
        on a GPU only (`device`: the compute device's type, "cpu" or "cuda"). On a CPU an MoE's
        verification window of k+1 rows routes to about k+1 times the experts of one row and streams
        their weights, so it costs about as much as k+1 plain steps: on the embedded pair speculation
        measured 0.48-0.99x of plain decoding in every cell of docs/benchmarks/speculative.md."""
        draft = self.draft
        sibling = Path(model_dir).resolve().parent / "draft"
        if (
            draft is None
            and self.speculative in ("auto", "draft")
            and (sibling / "config.json").exists()
            and sibling != Path(model_dir).resolve()
        ):
            draft = str(sibling)
        mode, why = self.speculative, f"--speculative {self.speculative}"
        if mode == "auto" and not draft:
            mode, why = "off", "auto: no draft model given or found beside the model"
        elif mode == "auto" and device == "cpu":
            mode, why = (
                "off",
                (
                    "auto: on a CPU a verification window of an MoE costs about its rows decoded one by one; "
                    "--speculative draft to speculate anyway"
                ),
            )
        elif mode == "auto":
            mode, why = "draft", f"auto: a draft model beside the model, on {device}"
        if mode == "draft" and draft is None:
            raise ConfigError(
                f"--speculative draft needs a draft model: pass --draft DIR (none found beside {model_dir})"
            )
        spec = SpecConfig(
            mode,
            draft if mode == "draft" else None,
            self.num_speculative_tokens,
            self.adaptive,
            self.ngram_max,
        )
        return spec, why
