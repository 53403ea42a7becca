"""SpecPrefetch: the router adapter learns, the window-aware scheduler orders and bounds what it
submits, the adapter file belongs to one checkpoint, and prefetching never changes the output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.errors import ConfigError
from engine.offline.trace import record_trace
from engine.prefetch.adapter import RouterAdapter, load_adapter, save_adapter
from engine.prefetch.training import (
    AdapterData,
    data_from_trace,
    evaluate,
    model_fingerprint,
    moe_blocks,
    recall_at_k,
    train_adapter,
)
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams
from policies.prefetch_window import LATE_WEIGHT, PrefetchCandidate, schedule_prefetches

REPO = Path(__file__).resolve().parents[1]


# -- the scheduler ----------------------------------------------------------------------------


def test_scheduler_skips_resident_and_pending_and_respects_the_budget() -> None:
    cands = [PrefetchCandidate(e, c) for e, c in [(1, 0.9), (2, 0.8), (3, 0.7), (4, 0.6), (5, 0.2)]]
    out = schedule_prefetches(
        cands,
        is_resident=lambda e: e == 1,
        is_pending=lambda e: e == 3,
        copy_seconds=0.0,
        workers=1,
        queued=0,
        time_to_next=1.0,
        budget=2,
        min_confidence=0.5,
    )
    assert out == [2, 4]
    assert schedule_prefetches(
        cands, lambda e: False, lambda e: False, 0.0, 1, 0, 1.0, budget=10, min_confidence=0.5
    ) == [1, 2, 3, 4]


def test_a_late_guess_must_be_surer() -> None:
    # Copies take 1 ms, one at a time, next layer in 1.5 ms: only the first candidate lands in time.
    cands = [PrefetchCandidate(7, 0.95), PrefetchCandidate(8, 0.9), PrefetchCandidate(9, 0.6)]
    timely_only = schedule_prefetches(
        cands, lambda e: False, lambda e: False, 1e-3, 1, 0, 1.5e-3, budget=5, min_confidence=0.5
    )
    assert timely_only == [
        7,
        8,
    ]  # 8 lands late but 0.9 * LATE_WEIGHT >= 0.5; 9 is late and 0.6 * 0.7 < 0.5
    assert 0.9 * LATE_WEIGHT >= 0.5 > 0.6 * LATE_WEIGHT
    # With two copies in flight, 7 and 8 land in time and 9 late: 9 still fails.
    assert schedule_prefetches(
        cands, lambda e: False, lambda e: False, 1e-3, 2, 0, 1.5e-3, budget=5, min_confidence=0.5
    ) == [7, 8]
    # With a fast link everything lands in time, and 9 passes.
    assert schedule_prefetches(
        cands, lambda e: False, lambda e: False, 1e-5, 1, 0, 1.5e-3, budget=5, min_confidence=0.5
    ) == [7, 8, 9]
    # A queue of earlier transfers makes even the best guess late.
    assert (
        schedule_prefetches(
            [PrefetchCandidate(7, 0.6)],
            lambda e: False,
            lambda e: False,
            1e-3,
            1,
            5,
            1.5e-3,
            5,
            0.5,
        )
        == []
    )


# -- the adapter -------------------------------------------------------------------------------


def _synthetic(n: int, seed: int) -> AdapterData:
    """Next-layer logits = the base guess + a hidden linear map of x: the adapter can learn it."""
    g = torch.Generator().manual_seed(seed)
    D, E, A = 24, 16, 2
    W = torch.randn(E, D, generator=torch.Generator().manual_seed(99)) * 0.6
    x = torch.randn(n, A, D, generator=g)
    base = torch.randn(n, A, E, generator=g)
    teacher = base + x @ W.T * 1.5
    return AdapterData(x, base, teacher, teacher.topk(4, dim=-1).indices)


def test_adapter_learns_what_the_base_guess_misses() -> None:
    fit, held = _synthetic(4000, 1), _synthetic(1000, 2)
    base_recall = (
        sum(recall_at_k(held.base[:, a], held.true_ids[:, a]) for a in range(held.anchors))
        / held.anchors
    )
    adapter = train_adapter(fit, rank=16, steps=300, batch=256, lr=1e-2)
    learned = sum(evaluate(adapter, held)) / held.anchors
    assert learned > base_recall + 0.3 and learned > 0.9


def test_recall_at_k() -> None:
    pred = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.8, 0.9]])
    assert recall_at_k(pred, torch.tensor([[0, 1], [0, 1]])) == 0.5
    assert recall_at_k(pred, torch.tensor([[0, 1], [0, 1]]), k=4) == 1.0


@pytest.fixture(scope="module")
def tiny_adapter(tiny_ckpt, tmp_path_factory) -> Path:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig())
    try:
        ids = torch.randint(
            3, om.config.vocab_size, (1024,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        data = data_from_trace(
            record_trace(om, ids, 128, logits=True, hidden=True), om.model, om.moe_layers
        )
        adapter = train_adapter(data, rank=8, steps=60, batch=256)
        path = tmp_path_factory.mktemp("prefetcher") / "prefetcher.safetensors"
        return save_adapter(adapter, path, model_fingerprint(om.model))
    finally:
        om.close()


def test_an_adapter_for_another_checkpoint_is_refused(tiny_ckpt, tiny_adapter: Path) -> None:
    om = load_model(tiny_ckpt("olmoe"), EngineConfig())
    try:
        with pytest.raises(ConfigError, match="trained for another checkpoint"):
            load_adapter(tiny_adapter, model_fingerprint(om.model))
    finally:
        om.close()
    with pytest.raises(ConfigError, match="no prefetcher file"):
        load_model(
            tiny_ckpt("qwen3_moe"), EngineConfig(prefetch="adapter")
        )  # none beside the tiny model


def _outputs(om, spec: SpecConfig) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(3, om.config.vocab_size, (3 + 4 * i,), generator=g).tolist() for i in range(6)
    ]
    proposer, observers = make_speculation(spec.resolve(om.model_dir), om)
    core = EngineCore.for_model(
        om, CoreLimits(max_running=6, max_model_len=512), proposer, observers
    )
    outs = complete(
        core,
        [core.local_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts],
    )
    assert all(o.error is None for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(speculative="off"), SpecConfig(speculative="ngram", adaptive=False)],
    ids=["plain", "ngram"],
)
def test_prefetching_never_changes_the_output(
    tiny_ckpt, tiny_adapter: Path, spec: SpecConfig
) -> None:
    outs = {}
    for kinds in ("none", "adapter", "adapter,utility"):
        om = load_model(
            tiny_ckpt("qwen3_moe"),
            EngineConfig(
                cache_fraction=0.25, offload="disk", prefetch=kinds, prefetcher=str(tiny_adapter)
            ),
        )
        try:
            outs[kinds] = _outputs(om, spec)
            if "adapter" in kinds:
                s = om.stats.snapshot()
                # Issued, at least: whether a tiny random model's guesses are right is not the point here
                # (tests/test_spac.py checks the embedded model's adapter gets prefetches used).
                assert s["prefetch_issued"] > 0
        finally:
            om.close()
    assert outs["adapter"] == outs["none"] == outs["adapter,utility"]


def test_bad_prefetch_setting_is_one_line() -> None:
    with pytest.raises(ConfigError, match="prefetch must be"):
        EngineConfig(prefetch="oracle")


@pytest.mark.slow  # the whole CLI end to end (CI: 10 minutes); its parts are tested in this file
def test_train_prefetcher_cli(tiny_ckpt, tmp_path: Path) -> None:
    text = tmp_path / "data.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "p.safetensors"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "train-prefetcher",
            "--model",
            str(tiny_ckpt("qwen3_moe")),
            "--data",
            str(text),
            "--out",
            str(out),
            "--steps",
            "30",
            "--max-tokens",
            "2000",
            "--rank",
            "8",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out recall@" in r.stdout and out.is_file()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "train-prefetcher",
            "--data",
            str(tmp_path / "missing.txt"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert (
        bad.returncode == 2
        and "data file not found" in bad.stderr
        and "Traceback" not in bad.stderr
    )


@torch.inference_mode()
def test_selection_scores_rank_like_a_bias_corrected_router(tiny_ckpt) -> None:
    """DeepSeek-V3-style routers (glm4_moe here) pick on sigmoid(logits) + a balancing bias: the
    prefetcher ranks predictions the same way, so with the true logits it picks the router's experts."""
    from engine.prefetch.training import moe_blocks

    om = load_model(tiny_ckpt("glm4_moe"), EngineConfig())
    try:
        g = torch.Generator().manual_seed(3)
        for block in moe_blocks(om.model).values():
            router = getattr(block, block.adapter.router)
            router.e_score_correction_bias.copy_(
                torch.randn(router.e_score_correction_bias.shape, generator=g)
            )
            x = torch.randn(64, om.config.hidden_size, generator=g)
            logits, _, ids = block.adapter.route(block, x)
            mine = (
                block.adapter.selection_scores(block, logits.float())
                .topk(ids.shape[1], dim=-1)
                .indices
            )
            assert torch.equal(mine.sort(-1).values, ids.sort(-1).values)
            plain = logits.topk(
                ids.shape[1], dim=-1
            ).indices  # ranking raw logits ignores the bias and misses
            assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)
    finally:
        om.close()


@torch.inference_mode()
def test_slot_zero_is_the_first_choice_for_unsorted_routers(tiny_ckpt) -> None:
    """glm4_moe's router returns its top-k unsorted; the first-choice rule and traces read slot 0 as the
    expert with the largest gate, so the engine sorts what every router returns."""
    from engine.experts.routing_bus import RoutingEvent

    om = load_model(tiny_ckpt("glm4_moe"), EngineConfig())
    seen: list[RoutingEvent] = []
    unsubscribe = om.bus.subscribe(seen.append)
    try:
        om.model(
            input_ids=torch.randint(
                3, om.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5)
            )
        )
    finally:
        unsubscribe()
        om.close()
    assert seen
    for ev in seen:
        assert bool((ev.weights[:, :-1] >= ev.weights[:, 1:]).all())


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_folded_adapter_predicts_what_router_plus_adapter_do(tiny_ckpt, arch: str) -> None:
    """The engine runs the adapter folded into the next router (one matmul): same logits as the
    router's guess plus B·A·x + b_l."""
    om = load_model(tiny_ckpt(arch), EngineConfig())
    try:
        blocks = moe_blocks(om.model)
        D = om.model.config.hidden_size
        adapter = RouterAdapter(D, om.num_experts, rank=4, anchors=len(om.moe_layers) - 1)
        with torch.no_grad():
            for p in adapter.parameters():
                p.normal_(
                    generator=torch.Generator().manual_seed(p.numel())
                )  # B and b are zero at init: make them count
        x = torch.randn(3, D, generator=torch.Generator().manual_seed(7))
        nxt = blocks[om.moe_layers[1]]
        with torch.no_grad():
            want = adapter(x, 0, nxt.adapter.router_logits(nxt, x).float())
            w, b = adapter.folded(0, *nxt.adapter.router_linear(nxt, x))
            assert torch.allclose(torch.nn.functional.linear(x, w, b), want, rtol=1e-4, atol=1e-4)
    finally:
        om.close()


def test_confidence_is_the_measured_precision_per_rank() -> None:
    """The prefetcher scores its guesses for a layer when that layer routes: on the embedded model
    its first-ranked guess is right more often than its last, so their confidences separate."""
    from models import EMBEDDED_TARGET

    om = load_model(EMBEDDED_TARGET, EngineConfig(cache_fraction=0.25, prefetch="adapter"))
    try:
        pf = om.adapter_prefetcher
        assert pf.precision_at_rank == [0.5] * om.top_k  # the prior, before any layer routed
        ids = om.tokenizer(
            (EMBEDDED_TARGET.parent / "data" / "test.txt").read_text(encoding="utf-8")[:2000]
        )["input_ids"][:24]
        proposer, observers = make_speculation(
            SpecConfig(speculative="off").resolve(om.model_dir), om
        )
        core = EngineCore.for_model(
            om, CoreLimits(max_running=1, max_model_len=512), proposer, observers
        )
        complete(core, [core.local_request(ids, SamplingParams(max_tokens=64, ignore_eos=True))])
        p = pf.precision_at_rank
        assert all(0.0 <= v <= 1.0 for v in p) and p[0] > p[-1] + 0.1, p
    finally:
        om.close()


def test_the_per_layer_bound_fits_with_the_adapters_recipe() -> None:
    """bench/prefetch_bound.py's richer predictors start as the next router's guess and are fitted
    by the same loop as the adapter: on data the adapter can learn, so can they."""
    from engine.prefetch.predictors import PerLayerPredictor
    from engine.prefetch.training import fit_predictor

    fit, held = _synthetic(4000, 1), _synthetic(1000, 2)
    D, E, A = fit.x.shape[-1], fit.teacher.shape[-1], fit.anchors
    base_recall = sum(recall_at_k(held.base[:, a], held.true_ids[:, a]) for a in range(A)) / A
    for width in (0, 32):
        m = PerLayerPredictor(D, E, A, mlp_width=width)
        assert sum(evaluate(m, held)) / A == pytest.approx(
            base_recall
        )  # zero-initialised: exactly the guess
        fit_predictor(m, fit, steps=300, batch=256, lr=1e-2)
        assert sum(evaluate(m, held)) / A > base_recall + 0.3


def test_prefetch_auto_uses_a_matching_adapter_only_when_the_cache_misses(
    tiny_ckpt, tiny_adapter: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt("qwen3_moe"), model)

    def attached(d: Path, **kw) -> bool:
        om = load_model(
            d, EngineConfig(**{"policy": "quality-first", **kw})
        )  # prefetch="auto" is the default
        try:
            assert om.prefetchers == (
                ("adapter",) if om.adapter_prefetcher is not None else ()
            )  # what reports show
            return om.adapter_prefetcher is not None
        finally:
            om.close()

    assert not attached(model, cache_fraction=0.25)  # no adapter file beside the model
    shutil.copy(tiny_adapter, model / "prefetcher.safetensors")
    assert attached(model, cache_fraction=0.25)
    assert not attached(model)  # cache 1.0: nothing to prefetch
    assert not attached(model, cache_fraction=0.25, prefetch="none")
    assert not attached(
        model, cache_fraction=0.25, policy="fetch-all"
    )  # exact policy on a CPU: it would only cost time
    assert attached(model, cache_fraction=0.25, policy="speed-first")
    # An adapter made for another checkpoint: auto warns and serves without; asked for explicitly, it is an error.
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt("olmoe"), other)
    shutil.copy(tiny_adapter, other / "prefetcher.safetensors")
    with caplog.at_level("WARNING"):
        assert not attached(other, cache_fraction=0.25)
    assert "trained for another checkpoint" in caplog.text
    with pytest.raises(ConfigError, match="trained for another checkpoint"):
        attached(other, cache_fraction=0.25, prefetch="adapter")


def test_settled_prefetch_does_not_depend_on_transfer_timing() -> None:
    """Deterministic residency (eval's default): the same tokens prefetch, hit and fetch the same experts whether a
    copy takes microseconds (RAM) or 8 ms (the emulated hdd), although the scheduler would call the slow ones late."""
    from models import EMBEDDED_TARGET

    ids = (EMBEDDED_TARGET.parent / "data" / "test.txt").read_text(encoding="utf-8")[:2000]
    counts = []
    for link in (None, "hdd"):
        om = load_model(
            EMBEDDED_TARGET,
            EngineConfig(
                cache_fraction=0.25,
                prefetch="adapter",
                settle_background=True,
                link=link,
                policy="quality-first",
            ),
        )
        try:
            proposer, observers = make_speculation(
                SpecConfig(speculative="off").resolve(om.model_dir), om
            )
            core = EngineCore.for_model(
                om, CoreLimits(max_running=1, max_model_len=512), proposer, observers
            )
            complete(
                core,
                [
                    core.local_request(
                        om.tokenizer(ids)["input_ids"][:16],
                        SamplingParams(max_tokens=40, ignore_eos=True),
                    )
                ],
            )
            s = om.stats.snapshot()
            counts.append(
                {
                    k: s[k]
                    for k in (
                        "prefetch_issued",
                        "calls_hit",
                        "calls_fetched",
                        "substitutions",
                        "admissions",
                    )
                }
            )
            assert om.adapter_prefetcher.meter.copy_seconds > (
                5e-3 if link else 0.0
            )  # the link really was slow
        finally:
            om.close()
    assert counts[0] == counts[1] and counts[0]["prefetch_issued"] > 0, counts


def test_adapter_data_comes_from_a_bf16_checkpoint(tiny_ckpt) -> None:
    """A trace stores hidden states as float32; a bf16 model's router reads them in its own dtype,
    as it does while decoding (it failed with a dtype mismatch before)."""
    om = load_model(tiny_ckpt("qwen3_moe", dtype=torch.bfloat16), EngineConfig())
    try:
        assert next(om.model.parameters()).dtype == torch.bfloat16
        ids = torch.randint(
            3, om.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)
        )
        trace = record_trace(om, ids.tolist(), 32, logits=True, hidden=True)
        data = data_from_trace(trace, om.model, om.moe_layers)
        assert data.base.dtype == torch.float32 and torch.isfinite(data.base).all()
        assert data.base.shape[:2] == (len(ids), len(om.moe_layers) - 1)
    finally:
        om.close()
