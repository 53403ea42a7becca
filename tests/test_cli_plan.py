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
