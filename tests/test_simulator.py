"""The router-trace simulator drives the engine's own policies over a recorded trace."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.experts.link import parse_link
from engine.offline.simulator import HardwareProfile, simulate


def synthetic_trace(N: int = 200, L: int = 2, E: int = 16, k: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(N, L, E)).astype(np.float32)
    logits[: N // 2, :, :4] += 3.0  # topic A prefers experts 0-3, topic B experts 8-11
    logits[N // 2 :, :, 8:12] += 3.0
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1)[..., :k]
    w = np.take_along_axis(probs, ids, -1)
    return {"ids": ids, "weights": w / w.sum(-1, keepdims=True), "logits": logits, "meta": {"num_experts": E}}


HW = HardwareProfile(parse_link("100:100"), expert_nbytes=1_000_000, layer_compute_s=1e-3, expert_compute_s=1e-4)


def run(policy: str, fraction: float = 0.25, **kw) -> dict:
    return simulate(synthetic_trace(), EngineConfig(policy=policy, **kw).policies(), fraction, HW).to_dict()


def test_all_resident_has_no_stall() -> None:
    r = run("fetch-all", fraction=1.0)
    assert r["simulated"] and r["stall_s"] == 0.0 and r["hit_share"] == 1.0


def test_fetch_all_accounts_every_call_and_stalls() -> None:
    r = run("fetch-all")
    assert r["calls"] == 200 * 2 * 4 == r["calls_hit"] + r["calls_fetched"]
    assert r["calls_substituted"] == 0 and r["stall_s"] > 0
    # Each fetch costs ~10 ms on a 100 MB/s link: stall ≈ fetches x 10 ms (serial link).
    assert r["stall_s"] == pytest.approx(r["calls_fetched"] * HW.link.seconds_for(HW.expert_nbytes), rel=0.25)


def test_substitution_trades_fetches_for_mass() -> None:
    fa, thr, fc = run("fetch-all"), run("threshold"), run("first-choice")
    assert fc["fetched_per_token"] < thr["fetched_per_token"] < fa["fetched_per_token"]
    assert fc["tokens_per_s"] > thr["tokens_per_s"] > fa["tokens_per_s"]
    assert 0 < thr["mean_substituted_mass"] < fc["mean_substituted_mass"]


def test_admission_loads_substituted_experts_in_the_background() -> None:
    plain, adm = run("first-choice", eviction="frequency"), run("first-choice", eviction="frequency", admission="background")
    assert plain["admissions"] == 0 and adm["admissions"] > 0
    assert adm["evictions"] > plain["evictions"]


def test_frequency_eviction_survives_a_topic_shift() -> None:
    """Dynamic aging: after the shift, the new topic's experts must win slots (not churn)."""
    r = run("first-choice", eviction="frequency")
    assert r["hit_share"] > 0.85 and r["fetched_per_token"] < 0.2


def test_best_resident_needs_logits() -> None:
    tr = synthetic_trace()
    del tr["logits"]
    with pytest.raises(ValueError, match="--logits"):
        simulate(tr, EngineConfig(policy="threshold").policies(), 0.25, HW)
    r = simulate(tr, EngineConfig(policy="threshold", substitute="drop").policies(), 0.25, HW)
    assert r.calls_substituted > 0
