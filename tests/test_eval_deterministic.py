"""`moe-offload eval` is deterministic: background admissions land at a defined point (before the
next MoE layer plans), so the same command gives the same numbers, bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.offline.evaluation import teacher_forced_eval
from engine.worker.loader import load_model
from models import EMBEDDED_TARGET

TIMING = ("seconds", "stall_seconds")  # wall-clock figures: the only ones allowed to differ


def _eval(cfg: EngineConfig, ids: list[int]) -> dict:
    om = load_model(EMBEDDED_TARGET, cfg)
    try:
        r = teacher_forced_eval(om, ids, 128, cfg.policy).to_dict()
    finally:
        om.close()
    return {k: v for k, v in r.items() if k not in TIMING}


@pytest.mark.slow  # CI's 10 minutes: prompt rows' bits are pinned by test_batch_invariance and test_lean_forward
@pytest.mark.timeout(600)
def test_settled_eval_repeats_bit_for_bit() -> None:
    om = load_model(EMBEDDED_TARGET, EngineConfig())
    ids = om.tokenizer(
        (EMBEDDED_TARGET.parent / "data" / "test.txt").read_text(encoding="utf-8")[:20000]
    )["input_ids"][:256]
    om.close()
    cfg = EngineConfig(
        cache_fraction=0.25,
        offload="disk",
        policy="quality-first",
        link="hdd",
        settle_background=True,
    )
    first, second = _eval(cfg, ids), _eval(cfg, ids)
    assert first["admissions"] > 0, "the check needs background admissions to happen"
    assert first == second


def test_eval_cli_defaults_to_settled(monkeypatch) -> None:
    import cli.eval as cli_eval

    seen: list[EngineConfig] = []

    def fake_eval(om, ids, window, label):
        seen.append(om.engine_config)
        raise SystemExit(0)

    monkeypatch.setattr("engine.offline.evaluation.teacher_forced_eval", fake_eval)
    from cli.main import main

    with pytest.raises(SystemExit):
        main(
            [
                "eval",
                "--data",
                str(EMBEDDED_TARGET.parent / "data" / "test.txt"),
                "--max-tokens",
                "16",
            ]
        )
    assert seen and seen[0].settle_background
    assert replace(seen[0], settle_background=False) != seen[0]
    assert cli_eval is not None
