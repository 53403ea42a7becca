"""`moe-offload plan`: placement and projected speed from headers alone."""

from __future__ import annotations

import argparse

from cli.main import build_parser, main
from engine.budget import fmt_bytes


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
    # 8 experts a layer: the default trace's 128 merge 16 to one (engine/offline/projection.py)
    assert "8 of 16 experts (50%)" in out and "PROJECTED (simulated)" in out


def test_plan_help_explains_every_flag() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    plan = sub.choices["plan"]
    for action in plan._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    flags = {f for a in plan._actions for f in a.option_strings}
    assert {"--max-model-len", "--max-running", "--device-memory", "--host-memory"} <= flags
    text = plan.format_help()
    assert "KV reservation" in text and "projection" in text


def test_projecting_the_replayed_head_equals_projecting_the_whole_trace() -> None:
    """`plan` projects only the tokens it replays: routing, gates and the simulated tok/s must be
    those of the whole trace projected (here onto 4x the experts, top-10 from logits: random children)."""
    import dataclasses

    import numpy as np

    from cli.plan import SIM_TOKENS, _head
    from engine.config import EngineConfig
    from engine.offline.hardware import ModelShape
    from engine.offline.projection import project_trace
    from engine.offline.simulator import manual_costs, simulate

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


def _rows(out: str) -> dict[str, tuple[int, str]]:
    """The plan table's rows: pool -> (bytes, why)."""
    rows = {}
    for line in out.splitlines():
        parts = line.split(maxsplit=5)
        if line.startswith("  ") and len(parts) == 6 and parts[2].isdigit():
            rows[parts[0]] = (int(parts[2]), parts[5])
    return rows


def test_plan_reserves_kv_for_max_model_len_x_max_running(tiny_ckpt, capsys) -> None:
    """KV per token x --max-model-len x --max-running is the kv_cache row, and the fast tier is
    sized to what that row leaves of the budget."""
    model = str(tiny_ckpt("qwen3_moe"))  # 2 layers x 8 experts, context 512
    capsys.readouterr()

    def plan(budget: int | str, *extra: str) -> tuple[dict[str, tuple[int, str]], str]:
        argv = ["plan", "--model", model, "--device", "cpu", "--offload", "disk"]
        assert main([*argv, "--host-memory", str(budget), *extra]) == 0
        out = capsys.readouterr().out
        return _rows(out), out

    roomy, _ = plan("1GiB")  # every expert fits: the fixed rows and one slot's size
    slot = roomy["fast_tier"][0] // 16
    kv0 = roomy["kv_cache"][0]
    per_token = kv0 // (512 * 4)  # the open default: min(context 512, 8192) tokens x 4 sequences
    assert (
        "--max-model-len open" in roomy["kv_cache"][1] and "x 4 sequences" in roomy["kv_cache"][1]
    )
    fixed_but_kv = sum(roomy[p][0] for p in ("dense", "scratch", "headroom"))
    budget = fixed_but_kv + kv0 + 4 * slot  # the default plan gets 4 of 16 experts

    slots = {}
    for length, running in ((None, None), (512, 4), (256, 7), (128, 2)):
        extra = (
            []
            if length is None
            else ["--max-model-len", str(length), "--max-running", str(running)]
        )
        rows, out = plan(budget, *extra)
        kv, why = rows["kv_cache"]
        if length is not None:
            assert kv == per_token * length * running, (length, running)
            assert (
                f"x {length} tokens (--max-model-len {length}) x {running} sequences (--max-running)"
                in why
            )
            assert (
                f"--max-model-len {length} --max-running {running}" in out
            )  # the serve line plans the same
            # The paged pool serve makes of that row: its positions, at least one whole context.
            blocks = max(length * running, length) // 16
            assert f"KV pool (CPU, native attention): {blocks} blocks of 16 positions" in out
        assert rows["fast_tier"][0] == min(16, (budget - fixed_but_kv - kv) // slot) * slot
        slots[(length, running)] = n = rows["fast_tier"][0] // slot
        # The KV/expert split serve starts with, and how far it may move (half the slots, by default).
        assert (
            f"memory split: KV {fmt_bytes(kv)} + experts {fmt_bytes(n * slot)} ({n} slots)" in out
        )
        if n < 16:
            assert f"the KV pool may borrow up to {n // 2} expert slots" in out, out
        else:
            assert "fixed: the fast tier holds every expert" in out or "zero-copy" in out, out
    assert slots == {(None, None): 4, (512, 4): 4, (256, 7): 9, (128, 2): 16}
    assert main(["plan", "--model", model, "--max-running", "0"]) == 2


def test_serve_plans_kv_for_the_limits_it_was_given(tmp_path) -> None:
    from cli.serve import _kv_request
    from engine.memory.planner import KvRequest
    from server.config import ServerConfig

    def req(*argv: str) -> KvRequest:
        args = build_parser().parse_args(["serve", "--model", "m", *argv])
        base = ServerConfig.from_yaml(args.config) if args.config else ServerConfig()
        scfg = base.with_overrides(
            **{k: getattr(args, k) for k in ("max_running", "max_model_len")}
        )
        return _kv_request(args, scfg)

    assert req() == KvRequest(None, None)  # open: the plan's stated defaults, not 64 contexts
    assert req("--max-running", "8", "--max-model-len", "4096") == KvRequest(4096, 8)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("server:\n  max_running: 64\n")  # the default value, but given
    assert req("--config", str(cfg)) == KvRequest(None, 64)
    assert req("--config", str(cfg), "--max-running", "2") == KvRequest(None, 2)


def test_plan_dense_quant_shrinks_the_dense_pool(tiny_ckpt, capsys) -> None:
    """--dense-quant int8 as serve takes it: the dense pool holds the codes, and says so."""
    model = str(tiny_ckpt("qwen3_moe"))
    capsys.readouterr()

    def dense(*extra: str) -> tuple[int, str]:
        rc = main(["plan", "--model", model, "--device", "cpu", "--host-memory", "8GiB", *extra])
        line = next(
            ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["dense"]
        )
        assert rc == 0
        return int(line.split()[2]), line

    plain, _ = dense()
    quant, line = dense("--dense-quant", "int8")
    assert quant < plain and "less for linears held as int8" in line
