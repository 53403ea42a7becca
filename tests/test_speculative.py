"""Speculative decoding: exact greedy output with draft and n-gram proposers, the rejection
rule's output distribution, adaptive k, the sensor, and draft compatibility checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import chi2_pvalue
from tiny_models import ARCHS, make_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core.completion import complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.errors import ConfigError
from engine.speculative.config import SpecConfig
from engine.speculative.factory import check_draft, make_speculation
from engine.speculative.ngram import lookup
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams, seeded_draw, target_probs
from engine.worker.verify import verify_window
from models import EMBEDDED_DRAFT, EMBEDDED_TARGET
from policies.adaptive_k import AdaptiveK

# -- the acceptance rule ---------------------------------------------------------------------


def _emitted_first_tokens(rule, n: int = 20000) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    V = 6
    target_logits = torch.tensor(
        [[1.5, 0.2, -0.5, 0.9, -1.2, 0.0], [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]]
    )  # [k+1, V], k=1
    q = torch.softmax(
        torch.tensor([0.0, 1.8, 0.4, -0.3, 0.9, -2.0]), dim=-1
    )  # the draft's distribution
    params = SamplingParams(temperature=1.0, max_tokens=4)
    counts = [0] * V
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        out = rule(target_logits, [d], params, g, lambda row, acc: row, q[None])
        counts[out[0]] += 1
    return counts, torch.softmax(target_logits[0], dim=-1)


def test_rejection_sampling_emits_the_target_distribution() -> None:
    counts, p = _emitted_first_tokens(verify_window)
    n = sum(counts)
    assert chi2_pvalue(counts, [n * float(x) for x in p]) > 0.01


def test_the_distribution_test_rejects_a_wrong_rule() -> None:
    def always_accept(
        logits, drafts, params, g, process, probs
    ):  # the classic bug: trusting the draft
        return list(drafts) + [0]

    counts, p = _emitted_first_tokens(always_accept, n=5000)
    n = sum(counts)
    assert chi2_pvalue(counts, [n * float(x) for x in p]) < 0.01


# -- pure pieces -----------------------------------------------------------------------------


def test_ngram_lookup() -> None:
    toks = [1, 2, 3, 4, 5, 9, 2, 3]
    assert lookup(toks, 3, 3) == [4, 5, 9]  # "2 3" occurred before, followed by 4 5 9
    assert lookup([1, 2, 3], 2, 3) == []


def test_adaptive_k_backs_off_and_recovers() -> None:
    k = AdaptiveK(k_max=4)
    assert k.k_for("r") >= 1
    for _ in range(6):
        k.observe("r", 4, 0)
    ks = [k.k_for("r") for _ in range(100)]
    assert ks.count(0) >= 97 and 1 in ks  # off, with rare probes
    for _ in range(12):
        k.observe("r", 4, 4)
    assert k.k_for("r") >= 3  # near-perfect acceptance: long windows pay even at a row cost of 0.4
    assert AdaptiveK(k_max=4, row_cost=0.0).best_k(0.99) == 4
    assert AdaptiveK(k_max=3, adaptive=False).k_for("x") == 3


def test_adaptive_k_counts_the_cost_of_proposing() -> None:
    k = AdaptiveK(k_max=4, row_cost=0.1)
    assert k.best_k(0.5) >= 1  # cheap proposals (n-gram): worth it at 50 % acceptance
    for _ in range(20):
        k.observe_costs(0.9, None)  # a draft forward costs almost a target step
    assert (
        k.best_k(0.5) == 0 and k.best_k(0.95) == 0
    )  # 0.95 accepted still costs more than it yields
    assert AdaptiveK(k_max=4, proposal_cost=0.3, row_cost=0.1).best_k(0.95) >= 1


# -- exactness through the engine core --------------------------------------------------------


def _prompts_embedded(tok) -> list[list[int]]:
    root = EMBEDDED_TARGET.parent / "data"
    verse = tok((root / "test_shakespeare.txt").read_text(encoding="utf-8")[:60000])["input_ids"]
    docs = tok((root / "test_pydocs.txt").read_text(encoding="utf-8")[:60000])["input_ids"]
    out = [verse[i * 1500 : i * 1500 + 64] for i in range(7)] + [
        docs[i * 1500 : i * 1500 + 64] for i in range(7)
    ]
    for q in (
        "What is a generator?",
        "Tell me about Hamlet.",
        "How do I open a file?",
        "Who was the king?",
        "Explain list comprehensions.",
        "Write a sonnet.",
    ):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append(ids[:64])
    return out  # 20 prompts: verse, documentation, chat


def _run(om, spec: SpecConfig, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    proposer, observers = make_speculation(spec.resolve(om.model_dir), om)
    core = EngineCore.for_model(
        om, CoreLimits(max_running=8, max_model_len=2048), proposer, observers
    )
    outs = complete(core, [core.local_request(p, params) for p in prompts])
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return [o.token_ids for o in outs]


@pytest.mark.slow  # CI's 10 minutes: test_batch_invariance draws the embedded pair's draft and n-gram speculation
@pytest.mark.timeout(600)
@pytest.mark.parametrize("offload,fraction", [("ram", 1.0), ("disk", 0.25)])
def test_embedded_pair_speculation_is_exact(offload: str, fraction: float) -> None:
    om = load_model(
        EMBEDDED_TARGET, EngineConfig(cache_fraction=fraction, offload=offload, dtype="float32")
    )
    try:
        prompts = _prompts_embedded(om.tokenizer)
        # 64 new tokens in RAM; 32 from disk, where every step pays real reads (CI time).
        params = SamplingParams(max_tokens=64 if offload == "ram" else 32, ignore_eos=True)
        plain = _run(om, SpecConfig(speculative="off"), prompts, params)
        om.stats.reset()
        assert _run(om, SpecConfig(speculative="draft", adaptive=False), prompts, params) == plain
        s = om.stats.snapshot()
        assert (
            s["spec_drafts"] > 0 and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
        )  # partial acceptance happened
        assert om.store.pinned_count() == 0
        if fraction == 1.0:
            assert (
                _run(om, SpecConfig(speculative="ngram", adaptive=False), prompts, params) == plain
            )
            assert _run(om, SpecConfig(speculative="draft"), prompts, params) == plain  # adaptive k
    finally:
        om.close()


def make_tiny_draft(path: Path) -> Path:
    """A tiny dense qwen3 with the tiny MoE checkpoints' tokenizer."""
    tok = make_tokenizer()
    cfg = AutoConfig.for_model(
        "qwen3",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=len(tok),
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> Path:
    return make_tiny_draft(tmp_path_factory.mktemp("draft") / "draft")


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_architectures_with_a_tiny_draft(tiny_ckpt, tiny_draft: Path, arch: str) -> None:
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=0.25, offload="disk"))
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [
            torch.randint(3, om.config.vocab_size, (4 + 3 * i,), generator=g).tolist()
            for i in range(8)
        ]
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        plain = _run(om, SpecConfig(speculative="off"), prompts, params)
        assert (
            _run(
                om,
                SpecConfig(speculative="draft", draft=str(tiny_draft), adaptive=False),
                prompts,
                params,
            )
            == plain
        )
        assert _run(om, SpecConfig(speculative="ngram", adaptive=False), prompts, params) == plain
    finally:
        om.close()


def test_seeded_sampling_with_speculation_is_reproducible(tiny_ckpt, tiny_draft: Path) -> None:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig())
    try:
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
        spec = SpecConfig(speculative="draft", draft=str(tiny_draft), adaptive=False)
        a = _run(om, spec, [[5, 6, 7], [9, 10]], params)
        assert a == _run(om, spec, [[5, 6, 7], [9, 10]], params)
    finally:
        om.close()


def test_a_seeded_request_accepts_proposals_drawn_with_its_uniform() -> None:
    """A seeded request keeps a proposal only where it equals the token the target draws with the seed's
    uniform at that position (verify_window); the draft draws its proposals with the same uniform
    (`seeded_draw`), so a draft whose distribution is the target's has every proposal accepted, where a
    stream of its own matched about the sum of p squared of them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 64, generator=g) * 0.5  # flat: sum of p^2 about 1/50
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    first = 40
    drafts = [seeded_draw(target_probs(logits[i], params), 11, first + i) for i in range(4)]
    out = verify_window(logits, drafts, params, None, lambda row, _: row, first_position=first)
    assert out[:4] == drafts and len(out) == 5


def test_sensor_reports_window_counts(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("olmoe"), EngineConfig())
    try:
        reports = []
        om.bus.subscribe_windows(reports.append)
        _run(
            om,
            SpecConfig(speculative="ngram", adaptive=False),
            [[5, 6, 7, 5, 6, 7, 5, 6]],
            SamplingParams(max_tokens=12, ignore_eos=True),
        )
        assert reports
        for rep in reports:
            for w in rep.windows:
                assert int(w.counts.sum()) == w.rows * om.top_k  # each row activates top_k experts
                assert int(w.accepted_counts.sum()) == w.kept * om.top_k and 1 <= w.kept <= w.rows
                assert torch.equal(
                    rep.union[w.layer], w.counts
                )  # one request: the union is its window
        per_layer = om.stats.snapshot()["per_layer"]
        assert all(
            om.top_k <= row["distinct_experts_per_window"] <= om.num_experts for row in per_layer
        )
    finally:
        om.close()


def test_mismatched_draft_is_refused(tiny_ckpt, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="vocabulary"):
        check_draft(tiny_ckpt("qwen3_moe"), EMBEDDED_DRAFT)
    with pytest.raises(ConfigError, match="needs a draft model"):
        SpecConfig(speculative="draft").resolve(tiny_ckpt("qwen3_moe"))
    assert (
        SpecConfig().resolve(EMBEDDED_TARGET, "cuda").draft is not None
    )  # the embedded pair on a GPU: draft by default
    cpu, why = SpecConfig().choose(EMBEDDED_TARGET, "cpu")
    assert cpu.speculative == "off" and "on a CPU" in why  # where a verification window cannot pay
    assert SpecConfig().resolve(tiny_ckpt("qwen3_moe")).speculative == "off"


def test_structured_output_with_speculation_equals_without() -> None:
    """A JSON-schema request: the grammar masks the target at every verified row, proposals that
    break it are rejected, and greedy output equals speculation off (and parses)."""
    import json

    from engine.structured.spec import ConstraintSpec

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    om = load_model(EMBEDDED_TARGET, EngineConfig(dtype="float32"))
    try:
        ids = om.tokenizer("Describe Hamlet as JSON:")["input_ids"]
        spec_c = ConstraintSpec.json_schema(schema)

        def run(spec: SpecConfig) -> tuple[list[int], str]:
            proposer, observers = make_speculation(spec.resolve(EMBEDDED_TARGET), om)
            core = EngineCore.for_model(
                om, CoreLimits(max_running=2, max_model_len=2048), proposer, observers
            )
            out = complete(
                core, [core.local_request(ids, SamplingParams(max_tokens=48), constraint=spec_c)]
            )[0]
            assert out.error is None, out.error
            return out.token_ids, out.text

        plain = run(SpecConfig(speculative="off"))
        om.stats.reset()
        assert run(SpecConfig(speculative="draft", adaptive=False)) == plain
        assert om.stats.snapshot()["spec_drafts"] > 0
        if len(plain[0]) < 48:  # the grammar closed the object before max_tokens
            json.loads(plain[1])
    finally:
        om.close()


def test_adaptive_k_measures_the_row_cost() -> None:
    """A step with proposals against a plain step of the same batch: expensive rows switch speculation off."""
    k = AdaptiveK(k_max=4, row_cost=0.1)
    k.begin_step(1)
    assert k.k_for("r") == 0  # no plain step measured at batch 1 yet: decode plainly once
    k.observe_step(1, 0, 0.010)
    k.begin_step(1)
    assert k.k_for("r") >= 1
    for _ in range(12):
        k.observe_step(1, 2, 0.030)  # 2 extra rows cost 2 plain steps: v = 1.0
    assert abs(k.row_cost - 1.0) < 0.05
    assert k.best_k(0.6) == 0  # 60 % acceptance does not pay for rows that expensive
    k.begin_step(8)
    assert k.k_for("r") == 0  # a new batch size is measured again


def test_a_long_catch_up_is_not_charged_to_one_proposed_token() -> None:
    """A draft that caught up on a prompt (or on a stretch decoded without proposals) before proposing
    spent that prefill's time too: adaptive k must not read it as what one proposed token costs, or a
    one-token probe window looks as dear as a prefill and speculation never switches back on."""
    import time
    from types import SimpleNamespace

    from engine.speculative.proposals import ProposerBase

    class Timed(ProposerBase):
        caught_up_long = False

        def _propose(self, plan):
            time.sleep(0.005)
            self._caught_up_long = self.caught_up_long
            return plan

    def one_window(p: Timed) -> float:
        w = SimpleNamespace(request_id="a", num_draft=1, is_prefill=False)
        plan = SimpleNamespace(work=[w], free_ids=[])
        p.propose(plan)
        p.observe(plan, SimpleNamespace(seconds=0.02, results={}))
        return p.k.proposal_cost

    p = Timed(AdaptiveK(k_max=4), None)
    p.caught_up_long = True
    assert one_window(p) == 0.0  # not observed
    p.caught_up_long = False
    assert one_window(p) > 0.0  # a window's own proposing is


def test_adaptive_k_keeps_its_plain_baseline_fresh() -> None:
    k = AdaptiveK(k_max=4, row_cost=0.1, refresh_every=5)
    k.begin_step(2)
    k.observe_step(2, 0, 0.040)  # the first plain step after a prefill: cold, slow
    k.observe_step(2, 0, 0.020)
    assert k._plain_step[2] == 0.020  # a faster plain step replaces the baseline at once
    k.observe_step(2, 0, 0.030)
    assert 0.020 < k._plain_step[2] < 0.030  # a slower one moves it only part of the way
    plain_steps = []
    for _ in range(12):
        k.begin_step(2)
        ks = k.k_for("a"), k.k_for("b")
        plain_steps.append(ks == (0, 0))
        k.observe_step(2, 0 if ks == (0, 0) else sum(ks), 0.025)
    assert plain_steps.count(True) == 2  # one plain step after every 5 speculative ones
    k.observe_proposal_time(2, 0.005, step_seconds=0.050)
    # Measured against the plain step, not the longer verification step that followed.
    assert k.proposal_cost == pytest.approx((1 - k.decay) * 0.005 / k._plain_step[2])


def test_the_seeded_race_draws_each_token_by_its_weight_and_couples_close_distributions() -> None:
    """seeded_draw picks each index with probability weight / sum (never a zero weight), a function of the
    seed and position alone; two close distributions raced with the same draws agree at least
    (1 - d) / (1 + d) of the time, d their total variation distance."""
    w = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    n = 20000
    counts = torch.bincount(torch.tensor([seeded_draw(w, 7, pos) for pos in range(n)]), minlength=5)
    assert counts[4] == 0
    assert torch.allclose(counts[:4] / n, w[:4], atol=0.015), counts
    assert [seeded_draw(w, 7, pos) for pos in range(50)] == [
        seeded_draw(w, 7, pos) for pos in range(50)
    ]
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(64, generator=g), 0)
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(64, generator=g), 0)
    d = float((p - q).abs().sum()) / 2
    same = sum(seeded_draw(p, 3, pos) == seeded_draw(q, 3, pos) for pos in range(4000)) / 4000
    assert same >= (1 - d) / (1 + d) - 0.02, (same, d)
