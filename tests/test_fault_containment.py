"""A request can fail only itself (issue 30): the sampler is safe for any logits and valid
parameters, and a fault in one sequence's sampling, detokenization, proposal window or
forward ends that sequence alone while the rest of the batch finishes exactly."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core.completion import complete, generate
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest
from engine.core.step_types import StepPlan
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams, apply_penalties, sample, target_probs
from engine.worker.verify import verify_window

# -- the sampler, by property -------------------------------------------------------------

special = st.sampled_from([math.inf, -math.inf, math.nan, 3.4e38, -3.4e38, 1e30, -1e30, 0.0, 1e-45])
logit = st.one_of(
    special, st.floats(-1e4, 1e4), st.floats(allow_nan=True, allow_infinity=True, width=32)
)
temperature = st.one_of(
    st.sampled_from(
        [0.0, 5e-324, 1e-300, 1e-6, 1e-5, 1.0, 2.0, 1e30, 1e308, 1.7976931348623157e308]
    ),
    st.floats(0, 1e308),
)
top_p = st.one_of(
    st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0]),
    st.floats(5e-324, 1.0, exclude_min=False),
)
FAST = settings(
    max_examples=400,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def _possible(x: torch.Tensor) -> torch.Tensor:
    """[V] bool: the tokens a correct sampler may return for logits x (float32 view)."""
    x = x.float()
    if bool((x == math.inf).any()):
        return x == math.inf  # +inf outranks every number
    return torch.isfinite(x)


@FAST
@given(
    values=st.lists(logit, min_size=1, max_size=40),
    t=temperature,
    p=top_p,
    k=st.integers(0, 50),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    seed=st.integers(0, 2**31),
)
@example(
    values=[0.0, 9.430409702906072e-22], t=1e30, p=5e-324, k=0, dtype=torch.float32, seed=0
)  # a tie made by the temperature
@example(values=[float("nan")] * 3, t=1.0, p=1.0, k=0, dtype=torch.float32, seed=0)
@example(
    values=[1.0, float("inf"), float("nan"), float("inf")],
    t=0.0,
    p=1.0,
    k=0,
    dtype=torch.float32,
    seed=0,
)
def test_sampler_returns_a_possible_token_or_a_clear_value_error(
    values, t, p, k, dtype, seed
) -> None:
    logits = torch.tensor(values, dtype=torch.float64).to(dtype)  # the cast itself may add inf
    params = SamplingParams(max_tokens=1, temperature=t, top_p=p, top_k=k, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    allowed = _possible(logits)
    if not bool(allowed.any()):
        with pytest.raises(ValueError, match="no token can be sampled"):
            sample(logits, params, gen)
        return
    tok = sample(logits, params, gen)
    assert 0 <= tok < len(values) and bool(allowed[tok]), (tok, values)
    if not params.greedy:
        probs = target_probs(logits, params)
        assert bool(torch.isfinite(probs).all()) and abs(float(probs.sum()) - 1) < 1e-4
        # The most likely possible token always survives top-k and top-p.
        x = logits.float()
        top = allowed & (x == x[allowed].max())  # ties: any of them may be the one kept
        assert float(probs[~allowed].sum()) == 0
        if not float(probs[top].sum()) > 0:
            # A tie made by the temperature: once scaled, a kept token's gap to the maximum
            # vanishes in float32, so the two are the same to the sampler (e.g. t = 1e30).
            gaps = (x[allowed].max().double() - x.double()[probs > 0]) / min(max(t, 1e-5), 1e30)
            assert bool((gaps < 1e-30).all()), (values, t, p, k)


@FAST
@given(
    values=st.lists(st.floats(-1e4, 1e4), min_size=2, max_size=20),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    history=st.lists(st.integers(0, 1), max_size=200),
    t=temperature,
    p=top_p,
)
def test_penalties_within_the_api_range_never_break_sampling(
    values, presence, frequency, history, t, p
) -> None:
    logits = apply_penalties(torch.tensor(values), history, presence, frequency)
    tok = sample(
        logits,
        SamplingParams(max_tokens=1, temperature=t, top_p=p),
        torch.Generator().manual_seed(0),
    )
    assert 0 <= tok < len(values)


def test_invalid_parameters_are_clear_value_errors() -> None:
    for kw, msg in [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="penalties must be finite"):
        apply_penalties(torch.zeros(4), [1], math.inf, 0.0)


@FAST
@given(
    values=st.lists(logit, min_size=3, max_size=12),
    q_bad=st.sampled_from([math.nan, math.inf, -1.0, 0.0]),
    t=temperature,
    d=st.integers(0, 2),
)
def test_verification_survives_a_broken_draft_distribution(values, q_bad, t, d) -> None:
    logits = torch.tensor([values, values])  # [k+1 = 2, V]
    if not bool(_possible(logits[0]).any()):
        return  # covered by the sampler property above
    q = torch.full((1, len(values)), q_bad)
    params = SamplingParams(max_tokens=2, temperature=t)
    out = verify_window(
        logits, [d], params, torch.Generator().manual_seed(1), lambda row, acc: row, q
    )
    assert 1 <= len(out) <= 2 and all(bool(_possible(logits[0])[x]) for x in out[-1:])


# -- one bad sequence among eight ------------------------------------------------------------


def _prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def om(tiny_ckpt):
    m = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0))
    yield m
    m.close()


def _eight(om, core: EngineCore) -> tuple[list, list[list[int]]]:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(om.config.vocab_size, 8)
    alone = [generate(om, p, params).token_ids for p in prompts]
    reqs = [core.local_request(p, params) for p in prompts]
    return reqs, alone


def _check_one_failed(outs, alone, bad: int, stage: str) -> None:
    for i, (c, solo) in enumerate(zip(outs, alone)):
        if i == bad:
            assert (
                c.finish_reason == "error"
                and c.error.startswith(f"{stage} failed for this request")
                and "error id err-" in c.error
            ), c.error
        else:
            assert c.error is None and c.token_ids == solo, (i, c.error)


def test_sampling_fault_fails_only_its_sequence(om, monkeypatch) -> None:
    core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
    reqs, alone = _eight(om, core)
    bad_id, calls = reqs[3].request_id, {"n": 0}
    real = core.runner._finish

    def flaky(w, logits, *greedy):  # sampling and verification run in _finish
        if w.request_id == bad_id:
            calls["n"] += 1
            if calls["n"] == 3:  # mid-generation: two tokens already went out
                raise RuntimeError(
                    "probability tensor contains either `inf`, `nan` or element < 0 (injected)"
                )
        return real(w, logits, *greedy)

    monkeypatch.setattr(core.runner, "_finish", flaky)
    outs = complete(core, reqs)
    assert calls["n"] == 3
    _check_one_failed(outs, alone, 3, "sampling")
    assert len(outs[3].token_ids) == 2
    assert not core.has_work() and core.runner.caches == {}  # every cache was freed


def test_nan_logits_in_a_batched_greedy_step_fail_only_their_sequence(om, monkeypatch) -> None:
    """Eight plain greedy streams take their tokens from one reduction (runner._plain_greedy_tokens);
    a row whose logits are all NaN there fails its request alone, as a solo row would."""
    core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
    reqs, alone = _eight(om, core)
    bad_id, calls = reqs[3].request_id, {"n": 0}
    real = core.runner.forward

    def nan_row(windows, starts, caches, keep, request_ids=(), kind="forward"):
        out = real(windows, starts, caches, keep, request_ids, kind)
        if kind == "decode" and bad_id in request_ids and len(request_ids) > 1:
            calls["n"] += 1
            if calls["n"] == 2:  # mid-generation, in a step shared with the other seven
                i = request_ids.index(bad_id)
                out[i] = torch.full_like(out[i], float("nan"))
        return out

    monkeypatch.setattr(core.runner, "forward", nan_row)
    outs = complete(core, reqs)
    assert calls["n"] >= 2
    _check_one_failed(outs, alone, 3, "sampling")
    assert not core.has_work() and core.runner.caches == {}


def test_detokenization_fault_fails_only_its_sequence(om) -> None:
    core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
    reqs, alone = _eight(om, core)
    for r in reqs:
        core.add(r)
    seq = core.scheduler.waiting[5]
    real = seq.detok.append

    def broken(ids: list[int]) -> None:
        if len(seq.detok.tokens) >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        real(ids)

    seq.detok.append = broken  # type: ignore[method-assign]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    errors: dict[str, str | None] = {}
    while core.has_work():
        for o in core.step():
            got[o.request_id] += o.token_ids
            if o.finish_reason:
                errors[o.request_id] = o.error
    for i, r in enumerate(reqs):
        if i == 5:
            assert (
                errors[r.request_id].startswith("detokenization failed for this request")
                and "error id err-" in errors[r.request_id]
            )
        else:
            assert errors[r.request_id] is None and got[r.request_id] == alone[i]
    assert core.runner.caches == {}


class _FailingProposer:
    """Proposes one (wrong) token per decode window, and fails on request `bad`'s windows."""

    def __init__(self, bad: str) -> None:
        self.bad = bad

    def propose(self, plan: StepPlan) -> StepPlan:
        if any(w.request_id == self.bad and not w.is_prefill for w in plan.work):
            raise IndexError("draft window out of range (injected)")
        return StepPlan(
            [
                w
                if w.is_prefill or w.max_draft == 0
                else replace(w, input_ids=w.input_ids + [1], num_draft=1)
                for w in plan.work
            ],
            plan.free_ids,
        )

    def observe(self, plan: StepPlan, out) -> None:
        pass


def test_proposer_fault_fails_only_its_window(om) -> None:
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = _prompts(om.config.vocab_size, 8)
    alone = [generate(om, p, params).token_ids for p in prompts]
    reqs = [GenerateRequest(f"local-{i}", p, params) for i, p in enumerate(prompts)]
    core = EngineCore.for_model(
        om, CoreLimits(max_running=8, max_model_len=512), _FailingProposer(reqs[6].request_id)
    )
    outs = complete(core, reqs)
    _check_one_failed(outs, alone, 6, "proposing")


def test_forward_fault_is_bisected_to_its_sequence(om, monkeypatch) -> None:
    """A forward that raises whenever one request's window is in it: the step is bisected
    until that request stands alone; the other seven are exact."""
    core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
    reqs, alone = _eight(om, core)
    bad_id = reqs[2].request_id
    real = core.runner.forward

    def forward(windows, starts, caches, keep, request_ids=(), kind="forward"):
        out = real(
            windows, starts, caches, keep, request_ids, kind
        )  # the caches grow first: bisection must roll them back
        if bad_id in request_ids and starts[request_ids.index(bad_id)] > 0:
            raise RuntimeError("injected forward failure")
        return out

    monkeypatch.setattr(core.runner, "forward", forward)
    outs = complete(core, reqs)
    _check_one_failed(outs, alone, 2, "the forward pass")
