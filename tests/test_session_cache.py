"""Conversation snapshots (engine/worker/session_cache.py), the prompt cache of hybrid linear-attention and
sliding-window models: the store's bookkeeping (longest proper prefix, pins, byte bound, LRU) on plain caches,
and through the engine core on tiny fp32 checkpoints: an agent's second turn prefills only its new tokens
and gets a cold run's tokens (logprobs within 1e-4); two requests fork from one snapshot; a continuation that
differs from the sampled tokens still finds the prompt. Also the block prefix cache where the KV is counted,
not paged (a model off the lean forward): the scheduler asked only the pool, so it never hit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from engine.config import EngineConfig
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest
from engine.core.step_types import SeqWork, StepPlan
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model
from engine.worker.prefix_cache import PrefixCache
from engine.worker.sampling import SamplingParams
from engine.worker.session_cache import SessionCache, prompt_cache_for

pytestmark = pytest.mark.timeout(300)
LOGPROB_TOL = 1e-4  # transformers' forward in fp32, chunked at another boundary (measured <= 5e-7)
TINY_CFG = dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=8, hidden_size=16)


# -- the store, on plain full-attention caches ----------------------------------------------------
def _cache(positions: int, seed: int = 0) -> DynamicCache:
    g = torch.Generator().manual_seed(seed)
    cache = new_kv_cache(AutoConfig.for_model("qwen3", num_attention_heads=2, **TINY_CFG))
    for layer in range(2):
        cache.update(
            torch.randn(1, 2, positions, 8, generator=g),
            torch.randn(1, 2, positions, 8, generator=g),
            layer,
        )
    return cache


def _end(sc: SessionCache, rid: str, tokens: list[int], seed: int = 0) -> DynamicCache:
    """A request whose cache holds `tokens` (its prompt, one decode fed) ends: `sc` keeps it."""
    req = GenerateRequest(rid, tokens[:-1], SamplingParams(max_tokens=4))
    cache = _cache(len(tokens), seed)
    sc.ran(SeqWork(rid, tokens[-1:], len(tokens) - 1, False, req, (tokens[-1], 7)), None)
    sc.release(rid, cache)
    return cache


SNAP_BYTES = 2 * 2 * 2 * 8 * 4  # per position: layers x (k, v) x [2 heads, 8] f32


def test_match_finds_the_longest_proper_prefix_and_forks_copy_it() -> None:
    sc = SessionCache(max_bytes=1 << 20)
    a = list(range(100, 140))
    src = _end(sc, "a", a)
    _end(sc, "b", a[:20], seed=1)
    assert len(sc.snapshots) == 2 and sc.bytes == 60 * SNAP_BYTES  # compacted to their positions
    assert sc.match("x", a) == 20  # all of `a` is no proper prefix of itself
    assert sc.match("y", a + [5]) == 40 and sc.match("z", a + [6, 7]) == 40  # two forks of `a`
    assert sc.match("w", [1] + a) == 0
    y, z = (
        new_kv_cache(AutoConfig.for_model("qwen3", num_attention_heads=2, **TINY_CFG)) for _ in "yz"
    )
    assert sc.restore("y", y) == 40 and sc.restore("z", z) == 40
    for sl, yl, zl in zip(src.layers, y.layers, z.layers):
        assert torch.equal(yl.keys, sl.keys) and torch.equal(zl.values, sl.values)
    y.update(
        torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), 0
    )  # y appends; z and the snapshot do not see it
    assert z.layers[0].get_seq_length() == 40 and y.layers[0].get_seq_length() == 41
    assert sc.match("v", a + [5]) == 40
    assert (sc.hit_tokens, sc.query_tokens) == (20 + 40 + 40 + 40, 40 + 41 + 42 + 41 + 41)


def test_byte_bound_evicts_least_recently_used_and_keeps_pinned() -> None:
    sc = SessionCache(max_bytes=90 * SNAP_BYTES)
    a, b, c = ([k * 1000 + i for i in range(40)] for k in (1, 2, 3))
    _end(sc, "a", a)
    _end(sc, "b", b)
    assert sc.match("pin", a + [1]) == 40  # pins a and makes it the most recently used
    _end(sc, "c", c)  # 120 positions > 90: b, the least recently used unpinned, goes
    assert sc.bytes == 80 * SNAP_BYTES <= sc.max_bytes
    assert sc.match("q", b + [1]) == 0 and sc.match("r", c + [1]) == 40
    sc.release("r")
    _end(sc, "d", [9] * 40)  # a is pinned, c goes
    assert sc.match("s", c + [1]) == 0 and sc.match("t", a + [2]) == 40
    _end(
        sc, "huge", list(range(200))
    )  # larger than the whole budget: not kept, nothing evicted for it
    assert sc.match("u", list(range(201))) == 0 and sc.bytes == 80 * SNAP_BYTES


def test_an_undone_admission_leaves_neither_pin_nor_counts() -> None:
    sc = SessionCache(max_bytes=40 * SNAP_BYTES)
    a = list(range(40))
    _end(sc, "a", a)
    hits, asked = sc.hit_tokens, sc.query_tokens
    assert sc.match("x", a + [1]) == 40
    sc.release("x")  # the scheduler found no room: it waits and asks again later
    assert (sc.hit_tokens, sc.query_tokens) == (hits, asked)
    _end(sc, "b", [7] * 40)  # nothing pins a: it is evicted for b
    assert sc.match("x", a + [1]) == 0 and len(sc.snapshots) == 1


def test_a_failed_or_preempted_request_is_not_kept() -> None:
    sc = SessionCache(max_bytes=1 << 20)
    req = GenerateRequest("f", list(range(10)), SamplingParams(max_tokens=4))
    sc.ran(SeqWork("f", list(range(10)), 0, True, req, ()), None)
    sc.release("f", None)
    sc.ran(SeqWork("g", list(range(10)), 0, True, req, ()), None)
    sc.release("g", _cache(9))  # the cache does not hold what was reported: not keyed by a guess
    assert not sc.snapshots


def test_models_get_the_cache_that_holds_their_kv() -> None:
    def lm(model_type: str, **kw: object) -> SimpleNamespace:
        cfg = AutoConfig.for_model(model_type, **kw)
        return SimpleNamespace(
            config=cfg, engine_config=EngineConfig(prefix_cache_bytes=1 << 20), stats=None
        )

    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2)
    hybrid = lm("qwen3_next", layer_types=["linear_attention", "full_attention"], **small)
    sliding = lm("mistral", sliding_window=64, **small)
    full = lm("qwen3", **small)
    assert isinstance(prompt_cache_for(hybrid), SessionCache)  # type: ignore[arg-type]
    assert isinstance(prompt_cache_for(sliding), SessionCache)  # type: ignore[arg-type]
    assert isinstance(prompt_cache_for(full), PrefixCache)  # type: ignore[arg-type]
    full.engine_config = EngineConfig(prefix_cache_bytes=0)
    assert prompt_cache_for(full) is None  # type: ignore[arg-type]


# -- through the engine core ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3_next", "gpt_oss"])
def om(request, tiny_ckpt) -> Iterator:
    m = load_model(tiny_ckpt(request.param), EngineConfig(dtype="float32"))
    yield m
    m.close()


def _core(om) -> tuple[EngineCore, Counter[str]]:
    """A core with small prefill chunks, and the prompt positions each request had computed."""
    core = EngineCore.for_model(om, CoreLimits(max_model_len=256, prefill_token_budget=32))
    fed: Counter[str] = Counter()
    execute = core.runner.execute

    def counted(plan: StepPlan):
        for w in plan.work:
            fed[w.request_id] += len(w.input_ids) if w.is_prefill else 0
        return execute(plan)

    core.runner.execute = counted  # type: ignore[method-assign]
    return core, fed


def _run(core: EngineCore, prompts: dict[str, list[int]], n: int = 8) -> dict[str, tuple]:
    """Greedy: each request's tokens, top-5 logprobs per token, cached prompt tokens."""
    out: dict[str, tuple] = {k: ([], [], 0) for k in prompts}
    reqs = [
        GenerateRequest(k, p, SamplingParams(max_tokens=n, ignore_eos=True), logprobs=5)
        for k, p in prompts.items()
    ]
    for o in core.generate(reqs):
        ids, lps, _ = out[o.request_id]
        lps += [[x for _, x in lp.top] for lp in o.logprobs or []]
        out[o.request_id] = (ids + o.token_ids, lps, o.num_cached_tokens)
    return out


def _same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    diff = max(abs(x - y) for a, b in zip(got[1], want[1]) for x, y in zip(a, b))
    assert diff < LOGPROB_TOL, diff


def _text(om, s: str) -> list[int]:
    return om.tokenizer(s)["input_ids"]


PROMPT = "The quick brown fox jumps over the lazy dog. To be, or not to be, that is the question."


def test_second_turn_prefills_only_the_new_tokens(om) -> None:
    core, fed = _core(om)
    assert isinstance(core.runner.prefix, SessionCache)
    p = _text(om, PROMPT)
    first = _run(core, {"t1": p})["t1"]
    assert first[2] == 0 and fed["t1"] == len(p)
    new = _text(om, " Hello, how are you today? I am fine.")
    turn2 = p + first[0] + new
    hit = _run(core, {"t2": turn2})["t2"]
    computed = len(p) + len(first[0]) - 1  # turn 1 never fed its last sampled token
    assert hit[2] == computed
    assert fed["t2"] == len(new) + 1  # the new tokens, and turn 1's last token
    cold_core, cold_fed = _core(om)
    cold = _run(cold_core, {"t2": turn2})["t2"]
    assert cold[2] == 0 and cold_fed["t2"] == len(turn2)
    _same(hit, cold)
    sc = core.runner.prefix
    assert 0 < sc.bytes <= sc.max_bytes and om.stats.snapshot()["prefix_snapshots"] >= 1


def test_two_requests_fork_from_one_snapshot(om) -> None:
    core, fed = _core(om)
    p = _text(om, PROMPT)
    first = _run(core, {"t1": p})["t1"]
    forks = {
        "a": p + first[0] + _text(om, " Mixture-of-Experts models"),
        "b": p + first[0] + _text(om, " def main():"),
    }
    both = _run(core, forks)  # admitted in one step: both copy the same snapshot
    cold = _run(_core(om)[0], forks)
    for k in forks:
        assert both[k][2] == len(p) + len(first[0]) - 1
        _same(both[k], cold[k])
    # A continuation that is not the sampled one (a re-tokenized history) still finds the prompt.
    other = p + [(first[0][0] + 1) % 256] + _text(om, " Hello")
    again = _run(core, {"c": other})["c"]
    assert again[2] == len(p) and fed["c"] == len(other) - len(p)
    _same(again, _run(_core(om)[0], {"c": other})["c"])


def test_block_prefix_cache_hits_where_kv_is_counted_not_paged(tiny_ckpt) -> None:
    """mixtral runs off the lean forward, so no paged pool: the copying prefix cache holds the blocks."""
    m = load_model(tiny_ckpt("mixtral"), EngineConfig(dtype="float32"))
    try:
        core, fed = _core(m)
        assert core.runner.pool is None and isinstance(core.runner.prefix, PrefixCache)
        p = _text(m, PROMPT)
        first = _run(core, {"t1": p})["t1"]
        turn2 = p + first[0] + _text(m, " Hello")
        hit = _run(core, {"t2": turn2})["t2"]
        assert hit[2] == len(p) // 16 * 16 > 0 and fed["t2"] == len(turn2) - hit[2]
        _same(hit, _run(_core(m)[0], {"t2": turn2})["t2"])
    finally:
        m.close()
