"""Build the proposer and the sensor that a SpecConfig names, for a loaded target model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from engine.speculative.config import SpecConfig
from policies.adaptive_k import AdaptiveK


def check_draft(model_dir: str | Path, draft_dir: str | Path) -> None:
    """Refuse, in one line, a draft that cannot propose for this target: another vocabulary
    (embedding size) or another tokenizer. Cheap: reads config and tokenizer files only."""

    def vocab_size(d: str | Path) -> int:
        cfg = json.loads((Path(d) / "config.json").read_text())
        return int(cfg.get("text_config", cfg).get("vocab_size") or 0)

    if vocab_size(model_dir) != vocab_size(draft_dir):
        raise ConfigError(
            f"{draft_dir}: the draft's vocabulary ({vocab_size(draft_dir)} tokens) differs from the target's "
            f"({vocab_size(model_dir)}); a draft must share the target's tokenizer"
        )
    t, d = Path(model_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"
    if (
        t.exists()
        and d.exists()
        and json.loads(t.read_text()).get("model") != json.loads(d.read_text()).get("model")
    ):
        raise ConfigError(
            f"{draft_dir}: the draft's tokenizer differs from the target's; a draft must share the target's tokenizer"
        )


def make_speculation(spec: SpecConfig, om: Any) -> tuple[Any, tuple[Any, ...]]:
    """(proposer or None, step observers) for a resolved SpecConfig on the target `om`."""
    if spec.speculative == "off":
        return None, ()
    from engine.worker.packed_batch import NO_ROLLBACK_MODEL_TYPES

    if om.config.model_type in NO_ROLLBACK_MODEL_TYPES:
        raise ConfigError(
            f"speculative decoding is not supported for {om.config.model_type} (its linear-attention state "
            "cannot be rolled back after a rejected proposal); use --speculative off"
        )
    from engine.speculative.sensor import sensor_for

    k = AdaptiveK(spec.num_speculative_tokens, spec.adaptive)
    sensor = sensor_for(om)
    if spec.speculative == "ngram":
        from engine.speculative.ngram import NgramProposer

        return NgramProposer(k, om.stats, spec.ngram_max), (sensor,)
    from engine.speculative.draft import DraftProposer
    from engine.worker.loader import load_dense_model

    assert spec.draft is not None, "resolve() picks the draft"
    check_draft(om.model_dir, spec.draft)
    cfg = om.engine_config
    # The draft runs its target's native kernels (engine/native/loaded.py), as its steps share the target's.
    draft = load_dense_model(spec.draft, device=str(om.device), dtype=cfg.dtype, native=om.native)
    return DraftProposer(draft, k, om.stats), (sensor,)
