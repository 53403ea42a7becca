"""Prompt (prefix) caching: the block store's bookkeeping (hash chain, holders, byte cap, LRU),
and exactness through the engine core on the embedded model in fp32: a request that reads its
prefix from the cache gets the tokens and logprobs of one that prefills everything, with
speculative decoding off and on (rejected windows roll back), in batched steps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from engine.config import EngineConfig
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model
from engine.worker.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys
from engine.worker.sampling import SamplingParams
from models import EMBEDDED_DIR, EMBEDDED_TARGET

pytestmark = pytest.mark.timeout(300)
LOGPROB_TOL = 2e-5  # fp32: the same numbers up to the rounding of matmuls over different row counts (measured 1.4e-6)


def _filled_cache(n_layers: int, positions: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = new_kv_cache(
        AutoConfig.for_model(
            "qwen3",
            num_hidden_layers=n_layers,
            num_key_value_heads=2,
            head_dim=8,
            hidden_size=16,
            num_attention_heads=2,
        )
    )
    for layer in range(n_layers):
        cache.update(
            torch.randn(1, 2, positions, 8, generator=g),
            torch.randn(1, 2, positions, 8, generator=g),
            layer,
        )
    return cache


def test_hash_chain_names_the_whole_prefix() -> None:
    a, b = list(range(40)), list(range(40))
    b[3] = 99  # differs in block 0 only
    ka, kb = block_keys(a, 2), block_keys(b, 2)
    assert ka[0] != kb[0] and ka[1] != kb[1]  # block 1's tokens are equal, its prefix is not
    assert block_keys(a, 2) == ka and len(ka[0]) == 16


def test_match_restore_store_and_lru_under_a_byte_cap() -> None:
    ids = list(range(5 * BLOCK_TOKENS + 3))
    src = _filled_cache(2, len(ids))
    per_block = 2 * 2 * (2 * BLOCK_TOKENS * 8 * 4)  # layers x (k, v) x [2 heads, B, 8] f32
    pc = PrefixCache(max_bytes=6 * per_block)
    assert pc.match("a", ids) == 0
    pc.store("a", ids, src, len(ids))
    assert len(pc.blocks) == 5 and pc.bytes == 5 * per_block
    pc.release("a")
    # A prompt equal to the stored blocks: everything but its last token can come from the cache.
    assert pc.match("b", ids[: 3 * BLOCK_TOKENS + 1]) == 3 * BLOCK_TOKENS
    assert (
        pc.match("c", ids[: 3 * BLOCK_TOKENS]) == 2 * BLOCK_TOKENS
    )  # the last token is always computed
    dst = new_kv_cache(
        AutoConfig.for_model(
            "qwen3",
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            hidden_size=16,
            num_attention_heads=2,
        )
    )
    assert pc.restore("b", dst) == 3 * BLOCK_TOKENS
    for sl, dl in zip(src.layers, dst.layers):
        assert torch.equal(dl.keys, sl.keys[:, :, : 3 * BLOCK_TOKENS]) and torch.equal(
            dl.values, sl.values[:, :, : 3 * BLOCK_TOKENS]
        )
    # Another prompt needs 4 new blocks: only unheld blocks may go ("b" holds 3, "c" 2), least recent first.
    other = [1000 + t for t in ids]
    pc.store("d", other, _filled_cache(2, len(other), seed=1), 4 * BLOCK_TOKENS)
    assert pc.bytes <= pc.max_bytes
    held = set(block_keys(ids, 3))
    assert held <= set(pc.blocks)  # held blocks survive
    assert len(pc.blocks) == 6  # 3 held + 3 of "d": its 4th found no room
    pc.release("b")
    pc.release("c")
    pc.release("d")
    assert pc.match("e", ids) == 3 * BLOCK_TOKENS and pc.hit_tokens == 8 * BLOCK_TOKENS


def test_hybrid_and_sliding_window_models_are_not_cached() -> None:
    hybrid = AutoConfig.for_model(
        "qwen3_next",
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    assert not PrefixCache.supports(new_kv_cache(hybrid))
    sliding = AutoConfig.for_model(
        "mistral",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=64,
    )
    assert not PrefixCache.supports(new_kv_cache(sliding))
    assert PrefixCache.supports(
        new_kv_cache(
            AutoConfig.for_model(
                "qwen3", num_hidden_layers=2, hidden_size=32, num_attention_heads=2
            )
        )
    )


@pytest.fixture(scope="module")
def om():
    m = load_model(EMBEDDED_TARGET, EngineConfig(dtype="float32"))  # the exact reference
    yield m
    m.close()


def _run(
    core: EngineCore, reqs: list[GenerateRequest]
) -> dict[str, tuple[list[int], list[float], int]]:
    out: dict[str, tuple[list[int], list[float], int]] = {}
    for o in core.generate(reqs):
        ids, lps, _ = out.get(o.request_id, ([], [], 0))
        out[o.request_id] = (
            ids + o.token_ids,
            lps + [lp.logprob for lp in o.logprobs or []],
            o.num_cached_tokens,
        )
    return out


def _core(om, spec: str, prefix: bool) -> EngineCore:
    cfg = (
        SpecConfig(speculative="off")
        if spec == "off"
        else SpecConfig(speculative="draft", draft=str(EMBEDDED_DIR / "draft"), adaptive=False)
    )
    proposer, observers = make_speculation(cfg, om)
    core = EngineCore.for_model(
        om, CoreLimits(max_model_len=1024, prefill_token_budget=512), proposer, observers
    )
    if not prefix:
        core.runner.prefix = core.scheduler.prefix = None
        if core.scheduler.blocks is not None:  # the paged pool shares prefixes by reference
            core.scheduler.blocks.cache_prefixes = False
    return core


@pytest.mark.parametrize("spec", ["off", "draft"])
def test_engine_core_hit_equals_full_prefill(om, spec: str) -> None:
    tok = om.tokenizer
    shared = tok("ROMEO:\nBut soft, what light through yonder window breaks? " * 12)["input_ids"][
        :200
    ]
    prompts = {
        k: shared + tok(s)["input_ids"]
        for k, s in (
            ("a", " It is the east"),
            ("b", " JULIET: Ay me!"),
            ("c", " And Juliet is the sun."),
        )
    }
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reqs = {k: GenerateRequest(k, p, params, 3) for k, p in prompts.items()}
    ref = _run(_core(om, spec, prefix=False), list(reqs.values()))
    assert all(c == 0 for _, _, c in ref.values())
    core = _core(om, spec, prefix=True)
    if spec == "draft":
        om.stats.reset()
    first = _run(core, [reqs["a"]])
    assert first["a"][2] == 0 and first["a"][0] == ref["a"][0]
    # b and c arrive together: one batched prefill step, both reading the shared blocks a stored.
    both = _run(core, [reqs["b"], reqs["c"]])
    hit = (len(shared) // BLOCK_TOKENS) * BLOCK_TOKENS
    for k in ("b", "c"):
        ids, lps, cached = both[k]
        assert cached == hit
        assert ids == ref[k][0]
        assert max(abs(x - y) for x, y in zip(lps, ref[k][1])) < LOGPROB_TOL
    again = _run(core, [reqs["a"]])["a"]  # a's own blocks, all but its last token's
    assert (
        again[2] == (len(prompts["a"]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        and again[0] == ref["a"][0]
    )
    assert max(abs(x - y) for x, y in zip(again[1], ref["a"][1])) < LOGPROB_TOL
    if spec == "draft":
        s = om.stats.snapshot()
        assert (
            0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
        )  # windows were rejected and rolled back
    blocks = core.scheduler.blocks  # the paged pool shares the prefix blocks by reference
    assert blocks is not None and blocks.cache_prefixes
    assert blocks.counts().in_use == 0  # every request released its blocks


class _FakePrefix:
    """match() only, as the scheduler sees the cache: a fixed hit for prompts starting with 1."""

    def __init__(self, hit: int) -> None:
        self.hit, self.asked = hit, []

    def match(self, request_id: str, ids: list[int]) -> int:
        self.asked.append(request_id)
        return self.hit if ids[0] == 1 else 0


def test_scheduler_starts_prefill_after_the_cached_prefix() -> None:
    from engine.core.scheduler import Scheduler
    from engine.core.step_types import SeqResult, StepOutput

    class CharTok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids if i)

    s = Scheduler(
        CharTok(),
        {0},
        max_running=4,
        prefill_token_budget=10,
        max_model_len=200,
        prefix=_FakePrefix(32),
    )
    s.add(GenerateRequest("hit", [1] + [5] * 39, SamplingParams(max_tokens=2)))
    s.add(GenerateRequest("miss", [2] + [5] * 5, SamplingParams(max_tokens=2)))
    s.add(
        GenerateRequest("echo", [1] + [5] * 39, SamplingParams(max_tokens=2), prompt_logprobs=0)
    )  # needs every position
    plan = s.schedule()
    w = plan.work[0]
    assert (w.request_id, w.start_pos, len(w.input_ids), w.prefix_hit, w.new_seq, w.samples) == (
        "hit",
        32,
        8,
        32,
        True,
        True,
    )
    assert (
        plan.work[1].request_id,
        plan.work[1].start_pos,
        plan.work[1].prefix_hit,
        plan.work[1].new_seq,
    ) == ("miss", 0, 0, True)
    assert [w.request_id for w in plan.work] == ["hit", "miss"] and s.prefix.asked == [
        "hit",
        "miss",
    ]  # budget 10 = 8 + 2
    outs = s.update(
        plan,
        StepOutput({w.request_id: SeqResult(sampled=[97] if w.samples else []) for w in plan.work}),
    )
    assert [(o.request_id, o.num_cached_tokens) for o in outs] == [("hit", 32)]
    nxt = s.schedule().work
    assert [(w.request_id, w.start_pos, w.new_seq) for w in nxt][:2] == [
        ("hit", 40, False),
        ("miss", 2, False),
    ]
