"""The long-context pair (models/embedded/long): its configs, its card against its measurements,
and decoding past the embedded pair's 1024 positions through the engine like transformers."""

from __future__ import annotations

import json

from engine_helpers import greedy_in_engine_and_transformers
from transformers import AutoTokenizer

from engine.launch import max_model_len_of
from models import EMBEDDED_DIR, EMBEDDED_DRAFT, EMBEDDED_LONG_TARGET, EMBEDDED_TARGET

LONG_DIR = EMBEDDED_LONG_TARGET.parent


def _cfg(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_long_pair_is_the_embedded_pair_with_a_4096_token_context() -> None:
    for short, long in (
        (EMBEDDED_TARGET, EMBEDDED_LONG_TARGET),
        (EMBEDDED_DRAFT, LONG_DIR / "draft"),
    ):
        a, b = _cfg(short), _cfg(long)
        assert a.pop("max_position_embeddings") == 1024 and b.pop("max_position_embeddings") == 4096
        for c in (a, b):  # the version of transformers that wrote it, not the model's
            c.pop("transformers_version")
        assert a == b  # same architecture and sizes
        assert (short / "tokenizer.json").read_bytes() == (long / "tokenizer.json").read_bytes()
    assert max_model_len_of(EMBEDDED_LONG_TARGET, None) == 4096


def test_the_card_reports_its_measurements_and_the_long_stage_pays() -> None:
    """The card's tables are eval.json's (a stale card fails); past 2048 positions the long target
    predicts better than the embedded one, and on 256-token windows it costs at most 5 %."""
    card = (LONG_DIR / "README.md").read_text()
    ev = json.loads((LONG_DIR / "eval.json").read_text())
    short, long = ev["pairs"]["embedded pair"], ev["pairs"]["long pair"]
    for pair, r in ev["pairs"].items():
        assert f"| {pair} | {r['ppl_256']['target']:.2f} | {r['ppl_256']['draft']:.2f} |" in card
        ce = " | ".join(f"{v:.3f}" for v in r["by_position"]["target_ce"])
        assert f"| {pair} | target cross entropy (nats) | {ce} |" in card
    assert long["by_position"]["target_ce"][-1] < short["by_position"]["target_ce"][-1] - 0.3
    assert long["ppl_256"]["target"] <= 1.05 * short["ppl_256"]["target"]
    assert "[its card](long/README.md)" in (EMBEDDED_DIR / "README.md").read_text()


def test_the_long_target_decodes_past_1024_positions_like_transformers() -> None:
    tok = AutoTokenizer.from_pretrained(EMBEDDED_LONG_TARGET)
    text = (EMBEDDED_DIR / "data" / "test.txt").read_text()[:20000]
    ids = tok(text)["input_ids"][:1100]
    assert len(ids) == 1100
    res, expect = greedy_in_engine_and_transformers(EMBEDDED_LONG_TARGET, ids, 8)
    assert res.tokens == expect
