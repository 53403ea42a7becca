"""`moe-offload plan`: placement and projected speed from headers alone."""

from __future__ import annotations

import argparse

from server.cli import build_parser, main


def test_plan_prints_the_placement_a_projection_and_a_recommendation(tiny_ckpt, capsys) -> None:
    model = tiny_ckpt(
        "qwen3_moe", num_experts=128, moe_intermediate_size=8
    )  # 128 experts: the trace projects onto it
    rc = main(
        [
            "plan",
            "--model",
            str(model),
            "--hardware",
            "rtx4090-pcie4",
            "--device",
            "cpu",
            "--host-memory",
            "8GiB",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "memory plan" in out and "fast_tier" in out and "slow_tier" in out
    assert "PROJECTED (simulated): profile rtx4090-pcie4" in out
    for preset in ("fetch-all", "quality-first", "speed-first"):
        assert any(
            line.split()[:1] == [preset] and float(line.split()[1]) > 0 for line in out.splitlines()
        ), preset
    assert "recommended: moe-offload serve" in out and "no weights read" in out


def test_plan_follows_the_budgets_and_fails_with_one_line(tiny_ckpt, capsys) -> None:
    model = str(tiny_ckpt("qwen3_moe"))
    capsys.readouterr()  # the checkpoint builder's progress bars
    assert (
        main(
            [
                "plan",
                "--model",
                model,
                "--device",
                "cpu",
                "--offload",
                "ram",
                "--host-memory",
                "10MiB",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("moe-offload: error: memory plan:")
        and "memory plan:" in err[0]
        and "short by" in err[0]
    )
    assert (
        main(
            [
                "plan",
                "--model",
                model,
                "--device",
                "cpu",
                "--offload",
                "disk",
                "--cache-fraction",
                "0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "8 of 16 experts (50%)" in out and "no projection" in out
    )  # 8 experts: not a multiple of the trace's 128


def test_plan_help_explains_every_flag() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    plan = sub.choices["plan"]
    for action in plan._actions:
        assert action.help and len(action.help) > 10, action.option_strings


def test_projecting_the_replayed_head_equals_projecting_the_whole_trace() -> None:
    """`plan` projects only the tokens it replays: routing, gates and the simulated tok/s must be
    those of the whole trace projected (here onto 4x the experts, top-10 from logits: random children)."""
    import dataclasses

    import numpy as np

    from engine.config import EngineConfig
    from engine.offline.hardware import ModelShape
    from engine.offline.projection import project_trace
    from engine.offline.simulator import manual_costs, simulate
    from server.cli_plan import SIM_TOKENS, _head

    rng = np.random.default_rng(1)
    N, L, E, k = SIM_TOKENS + 200, 2, 16, 4
    logits = rng.normal(size=(N, L, E)).astype(np.float16)
    ids = np.argsort(-logits.astype(np.float32), -1)[..., :k].astype(np.int16)
    trace = {
        "tokens": np.arange(N, dtype=np.int32),
        "ids": ids,
        "weights": np.full((N, L, k), 1.0 / k, np.float32),
        "logits": logits,
        "meta": {"num_experts": E},
    }
    shape = ModelShape("x4", layers=6, experts=4 * E, top_k=6, hidden=64, moe_intermediate=32)
    whole = project_trace(trace, shape)
    head = project_trace(_head(trace, SIM_TOKENS), shape)
    assert head["ids"].shape[0] == SIM_TOKENS
    assert np.array_equal(whole["ids"][:SIM_TOKENS], head["ids"])
    assert np.array_equal(whole["weights"][:SIM_TOKENS], head["weights"])
    costs = manual_costs(500.0, 100.0, 1 << 20, 1e-4, 1e-4)
    for preset in ("fetch-all", "speed-first"):
        pol = (
            EngineConfig(policy=preset)
            if preset == "fetch-all"
            else EngineConfig(policy=preset, substitute="drop")
        )
        a, b = (  # the simulated counts and clock, not the replay's own wall time
            dataclasses.replace(
                simulate(t, pol.policies(), 0.25, costs, max_tokens=SIM_TOKENS), replay_s=0.0
            ).to_dict()
            for t in (whole, head)
        )
        assert str(a) == str(b) and a["tokens"] == SIM_TOKENS and 0 < a["hit_share"] < 1, preset
