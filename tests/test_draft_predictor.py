"""The draft-model predictor in the engine (engine/prefetch/draft_predictor.py): it starts
transfers only, so tokens and logprobs stay bitwise those of no prefetch, and what it predicts
for each row is what the draft's hidden state of that token says through its heads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from engine.config import EngineConfig
from engine.core.completion import complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.experts.routing_bus import StepContext
from engine.prefetch.adapter import save_adapter
from engine.prefetch.draft_predictor import DraftPredictor
from engine.prefetch.predictors import PerLayerPredictor, draft_hidden_states, fate_predictor
from engine.prefetch.training import model_fingerprint
from engine.speculative.config import SpecConfig
from engine.speculative.draft_prefetch import draft_predictor
from engine.speculative.factory import make_speculation
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


class Recorder(torch.nn.Module):
    """The heads, recording each call's input rows and anchor."""

    def __init__(self, heads: torch.nn.Module, anchors: int) -> None:
        super().__init__()
        self.inner, self.anchors = heads, anchors
        self.calls: list[tuple[torch.Tensor, int]] = []

    def forward(self, h: torch.Tensor, anchor: int, base: None) -> torch.Tensor:
        self.calls.append((h.clone(), anchor))
        return self.inner(h, anchor, base)


def _draft(vocab: int) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(1)
    return Qwen3ForCausalLM(cfg).eval()


def _run(
    ckpt: Path,
    adapter: Path,
    prompts: list[list[int]],
    predictor=None,
    spec: SpecConfig | None = None,
):
    """Greedy tokens and logprobs (top 3) of two concurrent requests, cache 0.25 on disk;
    predictor(om) builds the prefetcher's predictor, None: no prefetch."""
    om = load_model(
        ckpt,
        EngineConfig(
            cache_fraction=0.25,
            offload="disk",
            prefetch="none" if predictor is None else "adapter",
            prefetcher=str(adapter),
        ),
    )
    try:
        if predictor is not None:
            om.adapter_prefetcher.use_predictor(predictor(om))
        spec = spec or SpecConfig(speculative="off")
        proposer, observers = make_speculation(spec.resolve(ckpt), om)
        core = EngineCore.for_model(
            om, CoreLimits(max_running=2, max_model_len=256), proposer, observers
        )
        reqs = [
            core.local_request(p, SamplingParams(max_tokens=12, ignore_eos=True), logprobs=3)
            for p in prompts
        ]
        outs = complete(core, reqs)
        lps = [[(t.token_id, t.logprob, t.top) for t in o.logprobs or []] for o in outs]
        return [o.token_ids for o in outs], lps, om.stats.snapshot(), om.adapter_prefetcher
    finally:
        om.close()


def _setup(tiny_ckpt, tmp_path: Path, monkeypatch) -> tuple[Path, Path, Recorder, Qwen3ForCausalLM]:
    """The tiny target, an adapter file for it (the prefetcher needs one to start), recording heads
    and a random draft saved to tmp_path/draft."""
    # A random draft's guesses are right about top_k / E of the time: prefetch them all the same, so
    # that transfers really start.
    monkeypatch.setattr("engine.prefetch.adapter_prefetcher.MIN_CONFIDENCE", 0.0)
    ckpt = tiny_ckpt("qwen3_moe")
    om = load_model(ckpt, EngineConfig())
    try:
        E, A, V = om.num_experts, len(om.moe_layers) - 1, om.config.vocab_size
        adapter = save_adapter(
            fate_predictor(om.config.hidden_size, E, A),
            tmp_path / "p.safetensors",
            model_fingerprint(om.model),
        )
    finally:
        om.close()
    draft = _draft(V)
    draft.save_pretrained(tmp_path / "draft")
    torch.manual_seed(2)
    return ckpt, adapter, Recorder(PerLayerPredictor(16, E, A, fate_base=False), A), draft


def test_the_draft_predictor_keeps_the_output_and_predicts_what_the_draft_says(
    tiny_ckpt, tmp_path: Path, monkeypatch
) -> None:
    ckpt, adapter, heads, draft = _setup(tiny_ckpt, tmp_path, monkeypatch)
    V = draft.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (9, 5)]

    tokens, logprobs, _, _ = _run(ckpt, adapter, prompts)

    def build(om: object) -> DraftPredictor:
        return draft_predictor(om, tmp_path / "draft", heads)

    d_tokens, d_logprobs, stats, prefetcher = _run(ckpt, adapter, prompts, build)
    assert d_tokens == tokens and d_logprobs == logprobs  # bitwise: floats compared with ==
    assert stats["prefetch_issued"] > 0 and prefetcher.adapter.rows > 0

    # Every row the heads saw is the draft's hidden state of that token in its request's context:
    # the same rows as the draft run over each whole sequence at once.
    seen = torch.cat([h for h, a in heads.calls if a == 0])
    whole = draft_hidden_states(draft, [p + t[:-1] for p, t in zip(prompts, tokens)])
    assert seen.shape[0] == whole.shape[0]
    rows = sorted(seen.tolist())  # the step packs the two requests' rows in its own order
    assert torch.allclose(torch.tensor(rows), torch.tensor(sorted(whole.tolist())), atol=1e-5)
    assert {a for _, a in heads.calls} == set(range(heads.anchors))


def _hf_predictor(draft: Qwen3ForCausalLM, heads: torch.nn.Module) -> DraftPredictor:
    """The draft run through transformers' own forward."""

    def run(window: list[int], start: int, cache: DynamicCache) -> torch.Tensor:
        pos = torch.arange(start, start + len(window))[None]
        ids = torch.tensor([window])
        return draft.model(input_ids=ids, position_ids=pos, cache=cache).last_hidden_state[0]

    return DraftPredictor(run, lambda: DynamicCache(config=draft.config), heads)


@torch.inference_mode()  # as the prefetcher calls it
def test_a_step_without_tokens_is_not_predicted() -> None:
    draft = _draft(20)
    pred = _hf_predictor(draft, PerLayerPredictor(16, 4, 1, fate_base=False))
    assert not pred.begin_step(StepContext(), 3)
    assert pred.begin_step(StepContext.of(("a",), [[3, 4, 5]], [0]), 3)
    # A window after positions the draft never saw runs from an empty cache, not on stale context.
    assert pred.begin_step(StepContext.of(("b",), [[6, 7]], [40]), 2)
    alone = draft_hidden_states(draft, [[6, 7]])
    assert torch.allclose(pred(torch.zeros(2, 5), 0, None), pred.heads(alone, 0, None), atol=1e-5)
    # The next window of request a continues its cache where the window starts: the token at 2
    # replaces the 5 fed before.
    assert pred.begin_step(StepContext.of(("a",), [[9]], [2]), 1)
    ref = draft_hidden_states(draft, [[3, 4, 9]])[-1:]
    assert torch.allclose(pred(torch.zeros(1, 5), 0, None), pred.heads(ref, 0, None), atol=1e-5)


def test_under_speculation_the_draft_predictor_follows_rollbacks_and_keeps_the_output(
    tiny_ckpt, tmp_path: Path, monkeypatch
) -> None:
    """Verification windows of k + 1 rows, rejected tails cropped: the predictor's draft caches crop
    with them, and the output is speculation's own without prefetch, bit for bit."""
    ckpt, adapter, heads, draft = _setup(tiny_ckpt, tmp_path, monkeypatch)
    V = draft.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (7, 11)]
    # A fixed k: adaptive k follows the clock, and the windows must be the same in both runs.
    spec = SpecConfig(
        speculative="draft", draft=str(tmp_path / "draft"), num_speculative_tokens=3, adaptive=False
    )

    def build(om: object) -> DraftPredictor:
        return draft_predictor(om, tmp_path / "draft", heads)

    base = _run(ckpt, adapter, prompts, spec=spec)
    with_draft = _run(ckpt, adapter, prompts, build, spec=spec)
    assert with_draft[:2] == base[:2]
    assert with_draft[2]["spec_drafts"] > 0 and with_draft[2]["prefetch_issued"] > 0
    # Verification windows were predicted (the prompts' forward has 18 rows, a plain decode 1 or 2).
    assert any(2 < h.shape[0] < 18 for h, _ in heads.calls)
