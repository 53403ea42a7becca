"""Seed 004's llama.cpp baseline (bench/seed004_llama.py) without a server: the flags that make
`-md` speculate, and the response parsing that fails a run whose draft drafted nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.seed004_llama import DRAFT_TOKENS, figures, server_flags
from bench.seed004_page import llama_tpv


def _response(**timings: Any) -> dict[str, Any]:
    return {"timings": {"predicted_n": 64, "predicted_ms": 250.0, **timings}, "tokens": [1, 2]}


def test_the_draft_flags_name_the_speculation_type_and_k() -> None:
    flags = server_flags(Path("draft.gguf"), 1)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs["-md"] == "draft.gguf"
    assert pairs["--spec-type"] == "draft-simple"  # `-md` alone drafts nothing in this build
    assert pairs["--spec-draft-n-max"] == str(DRAFT_TOKENS) == "4"  # the engine's k
    assert server_flags(None, 1) == ()


@pytest.mark.parametrize("timings", [{}, {"draft_n": 0, "draft_n_accepted": 0}])
def test_a_draft_response_without_drafted_tokens_fails(timings: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match="drafted no tokens"):
        figures(_response(**timings), drafting=True)


def test_a_draft_response_gives_acceptance_and_tokens_a_verification() -> None:
    f = figures(_response(draft_n=104, draft_n_accepted=36), drafting=True)
    assert f["tok_s"] == pytest.approx(256.0)
    assert f["draft_acceptance"] == pytest.approx(36 / 104)
    assert f["tokens_per_verification"] == pytest.approx(64 / 28)
    assert llama_tpv(f) == "2.29 (35% of drafted accepted)"


def test_a_plain_response_needs_no_draft() -> None:
    f = figures(_response(), drafting=False)
    assert "draft_acceptance" not in f and f["produced"] == 64
    assert llama_tpv(f) == "–"
