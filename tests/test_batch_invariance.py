"""Exact under load: whatever state the engine is in, each request's tokens and per-token logprobs are
bitwise those of the same request alone at cache 1.0 without speculation.

A property test (Hypothesis) draws the states a busy server moves through: the fast tier's size,
the slow tier (RAM or disk) and an emulated link in front of it, speculation (off, a draft model, n-gram)
and its window, prefetch and eviction policies, CPU-run experts, 1-4 concurrent requests arriving at
different steps, the prefill token budget (chunked prompts) and the prefix cache with prompts that share
a prefix. Logprobs are compared bit for bit, not tokens alone: a token test passes until a near-tie.
Why it holds: every row of every step runs the native kernels, each of which computes a row the same way
whatever shares the call (engine/native/row_kernels.py).

The default run draws MAX_EXAMPLES cases per dtype (bf16, the embedded model's own, and f32); the slow
run (`-m slow`) draws SLOW_EXAMPLES.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.completion import Completion, complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.native.loaded import native
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams
from models import EMBEDDED_TARGET

MAX_EXAMPLES = 15  # per dtype: 30 cases in the default run
SLOW_EXAMPLES = 150  # per dtype: 300 in the slow run
MAX_TOKENS = 8
SHARED = "KING HENRY:\nNow, lords, what say you to this? "  # a prefix several prompts share
PROMPTS = (
    SHARED + "Speak",
    SHARED + "What news from France",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "To be, or not to be",
    "The king said",
)


@dataclass(frozen=True)
class Case:
    cell: dict
    speculative: str
    k: int
    prompts: tuple[int, ...]  # indices into PROMPTS
    arrivals: tuple[int, ...]  # the step at which each request joins
    max_tokens: int
    budget: int  # prefill token budget per step


@st.composite
def cases(draw: st.DrawFn) -> Case:
    fraction = draw(st.sampled_from([1.0, 0.5, 0.25, 0.1]))
    cell = dict(
        cache_fraction=fraction,
        offload=draw(st.sampled_from(["ram", "disk"])),
        link=draw(st.sampled_from([None, None, "hdd"])),
        prefetch=draw(st.sampled_from(["none", "utility"])),
        eviction=draw(st.sampled_from(["lru", "frequency", "utility", "reuse"])),
        cpu_experts=draw(st.sampled_from(["off", "auto", "all"])),
        prefix_cache_bytes=draw(st.sampled_from([0, 64 << 20])),
    )
    n = draw(st.integers(1, 4))
    return Case(
        cell=cell,
        speculative=draw(st.sampled_from(["off", "draft", "ngram"])),
        k=draw(st.integers(1, 4)),
        prompts=tuple(draw(st.lists(st.integers(0, len(PROMPTS) - 1), min_size=n, max_size=n))),
        arrivals=tuple(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))),
        max_tokens=draw(st.integers(2, MAX_TOKENS)),
        budget=draw(st.sampled_from([7, 16, 1024])),
    )


Result = tuple[list[int], list[float]]


def _run(om, case: Case) -> list[Result]:
    """The case's requests through one engine core, each joining at its arrival step."""
    spec = SpecConfig(speculative=case.speculative, num_speculative_tokens=case.k)
    proposer, observers = make_speculation(spec.resolve(om.model_dir), om)
    limits = CoreLimits(max_running=4, prefill_token_budget=case.budget, max_model_len=512)
    core = EngineCore.for_model(om, limits, proposer, observers)
    params = SamplingParams(max_tokens=case.max_tokens, ignore_eos=True)
    reqs = [core.local_request(_ids(om, PROMPTS[p]), params, logprobs=0) for p in case.prompts]
    done = {r.request_id: Completion(r.request_id, len(r.prompt_ids)) for r in reqs}
    pending = sorted(zip(case.arrivals, range(len(reqs))))
    step = 0
    while pending or core.has_work():
        while pending and pending[0][0] <= step:
            core.add(reqs[pending.pop(0)[1]])
        for out in core.step():
            c = done[out.request_id]
            c.token_ids += out.token_ids
            c.logprobs += out.logprobs or []
            if out.finish_reason is not None:
                c.error = out.error
        step += 1
    results = []
    for r in reqs:
        c = done[r.request_id]
        assert c.error is None, c.error
        results.append((c.token_ids, [lp.logprob for lp in c.logprobs]))
    return results


def _ids(om, text: str) -> list[int]:
    return list(om.tokenizer(text)["input_ids"])


@pytest.fixture(scope="module")
def references() -> Iterator[dict[str, dict[int, Result]]]:
    """Each prompt alone at cache 1.0 without speculation, MAX_TOKENS tokens, per dtype."""
    if native() is None:
        pytest.fail("no native kernels (no C compiler?): the exactness promise needs them")
    refs: dict[str, dict[int, Result]] = {}
    for dtype in ("bfloat16", "float32"):
        om = load_model(EMBEDDED_TARGET, EngineConfig(dtype=dtype))
        try:
            refs[dtype] = {
                p: _run(om, Case({}, "off", 1, (p,), (0,), MAX_TOKENS, 1024))[0]
                for p in range(len(PROMPTS))
            }
        finally:
            om.close()
    yield refs


def _check(references: dict[str, dict[int, Result]], dtype: str, case: Case) -> None:
    om = load_model(EMBEDDED_TARGET, EngineConfig(dtype=dtype, **case.cell))
    try:
        got = _run(om, case)
    finally:
        om.close()
    for p, (tokens, logprobs) in zip(case.prompts, got, strict=True):
        ref_tokens, ref_logprobs = references[dtype][p]
        n = case.max_tokens
        assert tokens == ref_tokens[:n], f"{case}: prompt {p} tokens differ"
        assert logprobs == ref_logprobs[:n], f"{case}: prompt {p} logprobs differ"


_SETTINGS = dict(
    deadline=None,
    derandomize=True,  # the same cases every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@settings(max_examples=MAX_EXAMPLES, **_SETTINGS)
@given(case=cases())
def test_every_state_gives_the_bits_of_one_request_alone(
    references, dtype: str, case: Case
) -> None:
    _check(references, dtype, case)


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@settings(max_examples=SLOW_EXAMPLES, **_SETTINGS)
@given(case=cases())
def test_every_state_gives_the_bits_of_one_request_alone_slow(
    references, dtype: str, case: Case
) -> None:
    _check(references, dtype, case)


@pytest.mark.timeout(600)
def test_seeded_sampling_is_the_same_alone_batched_and_speculated() -> None:
    """Temperature 0.8 with a seed: the same tokens and logprobs alone, in a batch of 8 (other prompts and
    seeds beside it), and with draft or n-gram speculation: each token is drawn by the seed and its
    position (engine/worker/sampling.py `seeded_generator`), from logits that are the same bits."""
    if native() is None:
        pytest.fail("no native kernels (no C compiler?): the exactness promise needs them")
    om = load_model(EMBEDDED_TARGET, EngineConfig(cache_fraction=0.5))
    try:

        def run(spec: str, n: int) -> list[Result]:
            proposer, observers = make_speculation(
                SpecConfig(speculative=spec).resolve(om.model_dir), om
            )
            core = EngineCore.for_model(om, CoreLimits(max_running=8), proposer, observers)
            reqs = [
                core.local_request(
                    _ids(om, PROMPTS[i % len(PROMPTS)]),
                    SamplingParams(max_tokens=24, temperature=0.8, seed=7 + i, ignore_eos=True),
                    logprobs=0,
                )
                for i in range(n)
            ]
            outs = complete(core, reqs)
            assert all(o.error is None for o in outs)
            return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

        alone = run("off", 1)[0]
        assert run("off", 8)[0] == alone
        for spec in ("draft", "ngram"):
            assert run(spec, 1)[0] == alone, spec
            assert run(spec, 8)[0] == alone, spec
        assert om.stats.snapshot()["spec_drafts"] > 0  # speculation ran
    finally:
        om.close()


def test_the_plan_names_the_numeric_family() -> None:
    """The plan line says whether rows are batch-invariant, and why not where they are not."""
    from engine.plan.execution import exactness

    assert exactness("fused", True, True)[0] == "batch-invariant"
    assert exactness("lean", True, True)[0] == "batch-invariant"
    assert "native-kernels off" in exactness("lean", False, False)[1]
    assert "transformers" in exactness("transformers", True, True)[1]
    assert "sdpa" in exactness("lean", True, False)[1]
