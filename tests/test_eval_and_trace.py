"""Teacher-forced perplexity per policy, and router traces."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_models import load_reference

from engine.config import EngineConfig
from engine.offline.evaluation import reference_nll, teacher_forced_eval
from engine.offline.trace import record_trace, save_trace
from engine.worker.loader import load_model

TEXT = (
    "To be, or not to be, that is the question. Mixture-of-Experts models route each token to a few experts. "
    * 6
)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe", "per-expert", num_experts=16, num_experts_per_tok=4)


@pytest.fixture(scope="module")
def token_ids(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)(TEXT)["input_ids"][:160]


def test_fetch_all_perplexity_equals_transformers(ckpt, token_ids) -> None:
    ref_nll, n = reference_nll(load_reference(ckpt), token_ids, window=64)
    om = load_model(ckpt, EngineConfig(cache_fraction=0.25, offload="disk"))
    try:
        res = teacher_forced_eval(om, token_ids, window=64, progress=False)
    finally:
        om.close()
    assert res.tokens == n
    assert res.nll == pytest.approx(ref_nll, rel=1e-5, abs=1e-6)
    assert res.calls_substituted == 0 and res.calls_fetched > 0  # the small cache really missed
    assert res.expert_calls == n * 2 * 4  # tokens x layers x top-k


def test_substituting_policies_account_their_calls(ckpt, token_ids) -> None:
    out = {}
    for policy in ("fetch-all", "threshold", "speed-first"):
        om = load_model(ckpt, EngineConfig(cache_fraction=0.25, policy=policy))
        try:
            out[policy] = teacher_forced_eval(om, token_ids, window=64, progress=False)
        finally:
            om.close()
    ref, thr, spd = out["fetch-all"], out["threshold"], out["speed-first"]
    for r in out.values():
        assert (
            r.calls_hit + r.calls_fetched + r.calls_substituted
            == r.expert_calls
            == ref.expert_calls
        )
    assert thr.calls_substituted > 0 and spd.calls_substituted > thr.calls_substituted
    assert spd.fetches_per_token < thr.fetches_per_token < ref.fetches_per_token
    assert 0 < thr.mean_substituted_mass < spd.mean_substituted_mass < 1
    assert spd.admissions > 0  # the preset's background admission ran
    assert thr.nll != ref.nll  # substitution changes the numbers (it is not exact)


def test_trace_matches_engine_routing(ckpt, token_ids, tmp_path) -> None:
    om = load_model(ckpt, EngineConfig(cache_fraction=0.5))
    try:
        trace = record_trace(om, token_ids, window=64, logits=True, hidden=True)
    finally:
        om.close()
    path = save_trace(trace, tmp_path / "t.npz")
    loaded = np.load(path)
    N, L, k = loaded["ids"].shape
    assert (N, L, k) == (len(token_ids), 2, 4)
    assert loaded["logits"].shape == (N, L, 16) and loaded["hidden"].shape == (N, L, 64)
    assert json.loads(str(loaded["meta"]))["top_k"] == 4
    # The reference model's own router, on the same windows, picks the same experts.
    ref = load_reference(ckpt)
    for start in range(0, N, 64):
        chunk = token_ids[start : start + 64]
        with torch.no_grad():
            router_logits = ref(torch.tensor([chunk]), output_router_logits=True).router_logits
        for layer in range(L):
            top = torch.topk(
                torch.softmax(router_logits[layer].float(), -1), 4, dim=-1
            ).indices.numpy()
            assert np.array_equal(top, loaded["ids"][start : start + len(chunk), layer])
            assert np.allclose(
                router_logits[layer].numpy(),
                loaded["logits"][start : start + len(chunk), layer],
                atol=1e-2,
            )


@pytest.mark.slow  # the whole CLI end to end (CI: 10 minutes); its parts are tested in this file
@pytest.mark.timeout(300)
def test_eval_cli_all_policies_writes_json_and_png(ckpt, tmp_path) -> None:
    data = tmp_path / "d.txt"
    data.write_text(TEXT)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "eval",
            "--model",
            str(ckpt),
            "--data",
            str(data),
            "--all-policies",
            "--cache-fraction",
            "0.25",
            "--max-tokens",
            "48",
            "--window",
            "48",
            "--out-json",
            str(tmp_path / "p.json"),
            "--plot",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "p.json").read_text())
    labels = [r["label"] for r in out["results"]]
    assert labels[0] == "fetch-all" and {
        "quality-first",
        "speed-first",
        "threshold",
        "first-choice",
    } <= set(labels)
    assert out["results"][0]["delta_ppl_pct"] == 0.0
    assert out["prefetch"] == "auto" and {r["prefetch"] for r in out["results"]} == {
        "none"
    }  # no adapter beside it
    assert "mass_hypothesis_pearson_r" in out
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert "speed-first" in proc.stdout and "ΔPPL" in proc.stdout
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "eval",
            "--model",
            str(ckpt),
            "--data",
            str(tmp_path / "none.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        missing.returncode == 2
        and "data file not found" in missing.stderr
        and "Traceback" not in missing.stderr
    )


@pytest.mark.timeout(300)
def test_trace_then_simulate_cli(ckpt, tmp_path) -> None:
    data = tmp_path / "d.txt"
    data.write_text(TEXT)
    trace = tmp_path / "t.npz"
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "cli", *a], capture_output=True, text=True, timeout=250
    )
    p = run("trace", "--model", str(ckpt), "--data", str(data), "--out", str(trace), "--logits")
    assert p.returncode == 0, p.stderr[-2000:]
    p = run(
        "simulate",
        "--trace",
        str(trace),
        "--all-policies",
        "--link",
        "sdcard",
        "--out-json",
        str(tmp_path / "s.json"),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("SIMULATED")
    rows = {r["label"]: r for r in json.loads((tmp_path / "s.json").read_text())["rows"]}
    assert rows["speed-first"]["fetched_per_token"] < rows["fetch-all"]["fetched_per_token"]
    assert all(r["simulated"] for r in rows.values())
