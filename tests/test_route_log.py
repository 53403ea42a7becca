"""The route log (--route-log) and Belady's MIN cut into passes (bench serve --belady)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve_belady import BeladyProbe, LoadMark
from engine.config import EngineConfig
from engine.core.completion import generate
from engine.experts.route_log import read_route_log
from engine.offline.belady import lru_loads, min_load_positions, min_loads
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


def test_min_load_positions_are_the_loads_min_makes() -> None:
    seq = [1, 2, 3, 1, 4, 2, 5, 1, 3, 4, 2, 5, 1]
    pos = min_load_positions(seq, 3)
    assert len(pos) == min_loads(seq, 3) <= lru_loads(seq, 3)
    assert pos[:3] == [0, 1, 2]  # the first use of each key loads it
    assert all(seq[p] not in seq[:p] or p > 2 for p in pos)


def test_the_log_names_each_layer_calls_experts_and_changes_no_token(
    tiny_ckpt, tmp_path: Path
) -> None:
    ckpt = tiny_ckpt("qwen3_moe")
    log = tmp_path / "routes.log"
    prompt, params = [5, 9, 13, 17, 21], SamplingParams(max_tokens=6)
    plain = load_model(ckpt, EngineConfig(device="cpu", cache_fraction=0.5))
    want = generate(plain, prompt, params, logprobs=1)
    plain.close()
    om = load_model(ckpt, EngineConfig(device="cpu", cache_fraction=0.5, route_log=str(log)))
    got = generate(om, prompt, params, logprobs=1)
    layers, E, slots = len(om.moe_layers), om.num_experts, om.store.n_slots
    om.close()
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    logged_slots, logged_experts, calls = read_route_log(log)
    assert (logged_slots, logged_experts) == (slots, E)
    # one call per MoE layer per forward: the prompt, then each decode step but the last token's
    assert len(calls) == layers * 6
    assert all(ids == sorted(set(ids)) and all(0 <= e < E for e in ids) for _, ids in calls)


def test_a_pass_counts_mins_loads_inside_its_own_calls(tmp_path: Path) -> None:
    log = tmp_path / "routes.log"
    calls = [(0, [1, 2]), (0, [3]), (0, [1, 4]), (0, [2, 5]), (0, [1, 3])]
    log.write_text(
        "# route log: slots 2 experts 8\n"
        + "".join(f"{l} {' '.join(map(str, e))}\n" for l, e in calls)
    )
    seq = [e for _, ids in calls for e in ids]
    every = min_load_positions(seq, 2)
    probe = BeladyProbe(log, "http://unused")
    whole = probe.compare(LoadMark(0, 0, 0.0), LoadMark(5, 20, 1.0), 10, 2.0)
    assert whole["min_loads_per_token"] == pytest.approx(len(every) / 10)
    assert whole["engine_loads_per_token"] == pytest.approx(2.0)
    # The last two calls start at flat position 5 (calls of 2, 1 and 2 keys before them).
    tail = probe.compare(LoadMark(3, 0, 0.0), LoadMark(5, 4, 1.0), 4, 2.0)
    assert tail["min_loads_per_token"] == pytest.approx(sum(p >= 5 for p in every) / 4)
    # Half the stall of 4 loads is saved if MIN made 2 of them: 1 s less of a 2 s pass.
    best = sum(p >= 5 for p in every)
    assert tail["projected_min_tok_s"] == pytest.approx(4 / (2.0 - (4 - best) * 0.25))
