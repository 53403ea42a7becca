"""Seed 003's baselines and their harness: the ProMoE-style and draft-model predictors share one
module, FATE is an adapter with nothing learned, any predictor drives the engine's prefetches
without changing its output, the simulator replays precomputed predictions, and the page renders
the paper's claims beside the measured rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.offline.sim_settings import TablePredictor, manual_costs
from engine.offline.simulator import simulate
from engine.prefetch.adapter import save_adapter
from engine.prefetch.predictors import PerLayerPredictor, draft_hidden_states, fate_predictor
from engine.prefetch.training import model_fingerprint, moe_blocks
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams

CACHES = ("warm", "cold", "cold, 1-token prompt")


def test_per_layer_predictor_one_anchor_or_one_per_row_agree() -> None:
    torch.manual_seed(0)
    m = PerLayerPredictor(6, 5, anchors=3, mlp_width=4, fate_base=False)
    x = torch.randn(7, 6)
    rows = m(x, torch.full((7,), 2, dtype=torch.long), None)
    assert torch.allclose(m(x, 2, None), rows)
    assert not torch.allclose(m(x, 0, None), rows)  # each anchor its own head
    mixed = m(x, torch.tensor([0, 1, 2, 0, 1, 2, 0]), None)
    assert torch.allclose(mixed[2], rows[2]) and torch.allclose(mixed[0], m(x, 0, None)[0])


def test_with_the_guess_a_predictor_starts_as_the_guess_without_it_ignores_it() -> None:
    x, base = torch.randn(4, 6), torch.randn(4, 5)
    assert torch.equal(PerLayerPredictor(6, 5, 2)(x, 1, base), base)
    free = PerLayerPredictor(6, 5, 2, fate_base=False)
    assert torch.equal(free(x, 1, base), free(x, 1, torch.zeros(4, 5)))


def test_fate_is_the_next_routers_guess_and_folds_into_its_weight() -> None:
    fate = fate_predictor(6, 5, anchors=2)
    x, base = torch.randn(4, 6), torch.randn(4, 5)
    assert torch.equal(fate(x, 0, base), base)
    W, b = torch.randn(5, 6), torch.randn(5)
    w, bb = fate.folded(1, W, b)
    assert torch.equal(w, W) and bb is not None and torch.equal(bb, b)
    assert fate.bias is None


def _trace(N: int = 160, L: int = 3, E: int = 16, k: int = 4) -> dict:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(N, L, E)).astype(np.float32)
    ids = np.argsort(-logits, axis=-1)[..., :k]
    w = np.ones((N, L, k), dtype=np.float32) / k
    return {"ids": ids, "weights": w, "meta": {"num_experts": E, "top_k": k}}


def test_table_predictor_replays_predictions_in_the_simulator() -> None:
    tr = _trace()
    right = TablePredictor(tr["ids"][:, 1:])  # the true next-layer experts
    assert right.predict(5, 0) == [int(e) for e in tr["ids"][5, 1]]
    assert right.predict(5, 2) == []  # nothing after the last layer
    wrong = TablePredictor((tr["ids"][:, 1:] + 8) % 16)
    # A load (1 ms) about as long as a layer: a prefetch one layer ahead can hide it.
    hw = manual_costs(1000.0, 100.0, 1_000_000, layer_compute_s=1e-3, expert_compute_s=1e-4)
    pol = EngineConfig(policy="fetch-all").policies()

    def sim(pred: TablePredictor | None) -> dict:
        return simulate(tr, pol, 0.25, hw, predictor=pred).to_dict()

    none, good, bad = sim(None), sim(right), sim(wrong)
    assert good["prefetch_precision"] > 0.9 and good["tokens_per_s"] > none["tokens_per_s"]
    assert bad["prefetch_wasted"] > bad["prefetch_used"]


def test_any_predictor_drives_the_engines_prefetches_and_never_the_output(
    tiny_ckpt, tmp_path: Path
) -> None:
    ckpt = tiny_ckpt("qwen3_moe")
    om = load_model(ckpt, EngineConfig())
    try:  # an adapter file for this checkpoint: FATE's, nothing to train
        D, E, A = om.config.hidden_size, om.num_experts, len(om.moe_layers) - 1
        path = save_adapter(
            fate_predictor(D, E, A), tmp_path / "p.safetensors", model_fingerprint(om.model)
        )
        blocks = moe_blocks(om.model)
        routers = [
            getattr(blocks[m], blocks[m].adapter.router).weight.float() for m in om.moe_layers[1:]
        ]
    finally:
        om.close()
    # A guess-free per-layer head that is each next router's own map: FATE's predictions through the
    # module path (no fold, no base), so its guesses are right as often as FATE's.
    heads = PerLayerPredictor(D, E, A, fate_base=False)
    with torch.no_grad():
        for h, w in zip(heads.heads, routers):
            h.weight.copy_(w)
            h.bias.zero_()
    with_guess = PerLayerPredictor(D, E, A, mlp_width=8)  # zero-initialised: the guess, unfolded

    def outputs(prefetch: str, predictor: torch.nn.Module | None = None) -> tuple[list, dict]:
        om = load_model(
            ckpt,
            EngineConfig(
                cache_fraction=0.25, offload="disk", prefetch=prefetch, prefetcher=str(path)
            ),
        )
        try:
            if predictor is not None:
                om.adapter_prefetcher.use_predictor(predictor)
            proposer, observers = make_speculation(SpecConfig(speculative="off").resolve(ckpt), om)
            core = EngineCore.for_model(
                om, CoreLimits(max_running=2, max_model_len=256), proposer, observers
            )
            g = torch.Generator().manual_seed(4)
            prompts = [
                torch.randint(3, om.config.vocab_size, (9,), generator=g).tolist() for _ in range(2)
            ]
            outs = complete(
                core,
                [
                    core.local_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
                    for p in prompts
                ],
            )
            return [o.token_ids for o in outs], om.stats.snapshot()
        finally:
            om.close()

    base, _ = outputs("none")
    runs = [outputs("adapter"), outputs("adapter", heads), outputs("adapter", with_guess)]
    assert all(out == base for out, _ in runs)
    assert all(s["prefetch_issued"] > 0 for _, s in runs), [s["prefetch_issued"] for _, s in runs]


def test_draft_hidden_states_run_each_window_on_its_own() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    draft = Qwen3ForCausalLM(cfg).eval()
    a, b = [3, 4, 5, 6], [7, 8, 9]
    both = draft_hidden_states(draft, [a, b])
    assert both.shape == (7, 16)
    assert torch.allclose(both[4:], draft_hidden_states(draft, [b]), atol=1e-5)
    assert not torch.allclose(both[4:], draft_hidden_states(draft, [a + b])[4:], atol=1e-5)


def _result() -> dict:
    names = [
        "SpecPrefetch (shipped: guess + B·A·x + bias)",
        "SpecPrefetch (paper's form: B·A·x)",
        "FATE (next router on x_l)",
        "ProMoE-style (per-layer MLP on x_l)",
        "draft model (heads on the draft's hidden state)",
    ]
    rows = [
        {"predictor": n, "recall_per_layer": [0.4, 0.6, 0.8], "recall": 0.6 - 0.05 * i,
         "parameters": 1000 * (i + 1), "parameters_with_draft": 1000 * (i + 1) + (5000 if i == 4 else 0)}
        for i, n in enumerate(names)
    ]  # fmt: skip
    none = "no prefetch"
    speed = [
        {"link": link, "cache": c, "predictor": n, "vs_none": 1.1, "tok_s": 50.0, "stall_share": 0.2,
         "hit_rate": 0.8, "prefetch_used": 3, "prefetch_issued": 4, "round_ratios": [0.9, 1.0, 1.1, 1.3]}
        for link in ("disk", "sdcard") for c in CACHES for n in [none, *names[:4]]
    ]  # fmt: skip
    profiles = ("this machine, disk", "this machine, disk + sdcard", "phone (UFS 3.1)")
    sim = [
        {"profile": p, "cache": c, "predictor": n, "tok_s": 60.0, "vs_none": 1.05,
         "stall_share": 0.1, "prefetch_precision": 0.5 if c == "warm" else None}
        for p in profiles for c in CACHES for n in [none, *names]
    ]  # fmt: skip
    sweep = {"mb_per_s": [25.0, 80.0, 8000.0], **{n: [1.3, 1.2, 1.0] for n in names}}
    args = {"link": "sdcard", "train_data": "t.txt", "data": "h.txt", "steps": "10", "prompt_tokens": "32",
            "tokens": "48", "cache_fraction": "0.25", "rounds": "3", "sim_requests": "4", "sweep_tokens": "64"}  # fmt: skip
    return {
        "machine": "Machine: test.", "model": "m", "draft": "d", "args": args, "seconds": 60.0,
        "rows": rows, "model_parameters": 100_000, "draft_parameters": 5000, "fit_tokens": 10,
        "held_tokens": 5, "top_k": 8, "simulated": sim, "sweep": {profiles[0]: sweep, profiles[2]: sweep},
        "speed": speed, "load_average": {"before": 6.5, "after": 7.0},
    }  # fmt: skip


def test_the_page_sets_every_claim_beside_a_row_and_keeps_its_analysis(tmp_path: Path) -> None:
    from bench.seed003_page import render, write_plot

    out = tmp_path / "003.md"
    out.write_text("old\n\n## Why the results differ\n\nhand-written.\n")
    d = _result()
    page = render(d, out)
    assert "89.13 %" in page and "1.14×" in page and "hand-written." in page
    claims = page[page.index("## The paper's claims") : page.index("## 1.")]
    assert claims.count("\n| ") == 6  # the header and the five claims
    assert "not run" not in claims and "draft 40.0%" in claims and "1.10×" in claims
    assert "draft model 1.05×" in claims  # simulated rows name the draft; measured ones cannot
    assert "(80 MB/s): SpecPrefetch 1.20×" in claims  # the phone at SD-card speed, from the sweep
    assert "| 0.93-1.25 |" in page  # the middle half of the rounds' ratios
    write_plot(d, out)
    assert out.with_name("003-bandwidth.png").stat().st_size > 1000


@pytest.mark.parametrize("missing", ["speed"])
def test_a_page_without_the_measured_run_says_so(tmp_path: Path, missing: str) -> None:
    from bench.seed003_page import render

    d = {**_result(), missing: []}
    page = render(d, tmp_path / "p.md")
    assert "Not run (`--no-speed`)" in page and "not run" in page


def test_a_draft_only_run_is_shown_apart_and_named_in_the_claims(tmp_path: Path) -> None:
    from bench.seed003_page import render

    d = _result()
    draft = d["rows"][4]["predictor"]
    rows = [
        {**r, "predictor": n, "draft_ms": 2.5} if n == draft else {**r, "predictor": n}
        for r in d["speed"][:1]
        for n in ("no prefetch", "FATE (next router on x_l)", draft)
    ]
    run = [
        {**r, "link": link, "cache": c} for link in ("disk", "sdcard") for c in CACHES for r in rows
    ]
    d["draft_run"] = {
        "machine": "Machine: second.", "args": {**d["args"], "rounds": "2"}, "seconds": 120.0,
        "rows": d["rows"][2:3] + d["rows"][4:], "speed": run, "load_average": {"before": 2.0, "after": 3.0},
    }  # fmt: skip
    page = render(d, tmp_path / "p.md")
    claims = page[page.index("## The paper's claims") : page.index("## 1.")]
    assert "draft model 1.10× (run 2)" in claims
    run2 = page[page.index("### Run 2") : page.index("## 3.")]
    assert "Machine: second." in run2 and "| 2.50 |" in run2 and "2.50-2.50 ms" in run2
    assert run2.count(draft) == 6  # its six cells, each beside its own no prefetch and FATE
