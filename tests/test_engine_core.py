"""The engine core: batched steps equal solo runs, rollback-ready windows, expert leases and
fault isolation, prefetch protection, and concurrent eviction during planning."""

from __future__ import annotations

import errno
import random
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import settle
from tiny_models import ARCHS

from engine.config import EngineConfig
from engine.core.completion import complete, generate
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest
from engine.core.step_types import StepPlan
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams

EMBEDDED = Path(__file__).resolve().parents[1] / "models" / "embedded" / "target"

SETTINGS = [("ram", 1.0), ("disk", 0.25)]


def _prompts(vocab: int, lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _batched_equals_alone(om, n: int = 8) -> None:
    prompts = _prompts(om.config.vocab_size, [3 + 5 * i for i in range(n)])
    max_tokens = [4 + 3 * (i % 4) for i in range(n)]
    alone = [
        generate(om, p, SamplingParams(max_tokens=m, ignore_eos=True)).token_ids
        for p, m in zip(prompts, max_tokens)
    ]
    core = EngineCore.for_model(
        om, CoreLimits(max_running=n, prefill_token_budget=64, max_model_len=1024)
    )
    together = complete(
        core,
        [
            core.local_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, max_tokens)
        ],
    )
    for i, c in enumerate(together):
        assert c.error is None, c.error
        assert c.token_ids == alone[i], (
            f"request {i} (prompt {len(prompts[i])}, max_tokens {max_tokens[i]}) differs when batched"
        )
    assert om.store.pinned_count() == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("offload,fraction", SETTINGS)
def test_batched_steps_equal_solo_runs(tiny_ckpt, arch: str, offload: str, fraction: float) -> None:
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=fraction, offload=offload))
    try:
        _batched_equals_alone(om)
    finally:
        om.close()


def test_batched_step_loads_each_expert_once(tiny_ckpt) -> None:
    """8 requests in one step: each MoE layer loads an expert at most once for all of them."""
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.25, offload="disk", warm_start=False)
    )
    try:
        loads: list[tuple[int, int]] = []
        fetch = om.transfers.tier._fetch
        om.transfers.tier._fetch = lambda layer, e, into=None: (
            loads.append((layer, e)),
            fetch(layer, e, into),
        )[1]  # type: ignore[method-assign]
        core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
        for p in _prompts(om.config.vocab_size, [1] * 8):
            core.add(core.local_request(p, SamplingParams(max_tokens=2, ignore_eos=True)))
        core.step()  # one step: the 8 one-token prompts run as one packed forward
        assert loads and len(loads) == len(set(loads))
    finally:
        om.close()


class ScriptedProposer:
    """Proposes the true continuation for the first `good` tokens, then wrong ones: partial acceptance."""

    def __init__(self, truth: dict[str, list[int]], k: int, vocab: int) -> None:
        self.truth, self.k, self.vocab = truth, k, vocab
        self.rng = random.Random(0)

    def propose(self, plan: StepPlan) -> StepPlan:
        work = []
        for w in plan.work:
            k = min(self.k, w.max_draft)
            if w.is_prefill or k == 0:
                work.append(w)
                continue
            done = len(w.output_ids)
            good = self.rng.randint(0, k)
            true = self.truth[w.req.request_id][done : done + k]
            drafts = true[:good] + [(t + 1) % self.vocab for t in true[good:k]]
            drafts += [1] * (k - len(drafts))
            work.append(replace(w, input_ids=w.input_ids + drafts, num_draft=k))
        return StepPlan(work, plan.free_ids)

    def observe(self, plan: StepPlan, out) -> None:
        pass


@pytest.mark.parametrize("offload,fraction", SETTINGS)
def test_rollback_with_partial_acceptance(tiny_ckpt, offload: str, fraction: float) -> None:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=fraction, offload=offload))
    try:
        prompts = _prompts(om.config.vocab_size, [4, 9, 6, 12])
        reqs = [
            GenerateRequest(f"local-{i}", p, SamplingParams(max_tokens=10 + i, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        plain = {r.request_id: generate(om, r.prompt_ids, r.params).token_ids for r in reqs}
        core = EngineCore.for_model(
            om,
            CoreLimits(max_running=8, max_model_len=512),
            ScriptedProposer(plain, 4, om.config.vocab_size),
        )
        for r in reqs:
            core.add(r)
        got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        windows_with_drafts = 0
        while core.has_work():
            outs = core.step()
            for o in outs:
                got[o.request_id] += o.token_ids
            windows_with_drafts += 1
            for rid, seq in core.scheduler.running.items():
                # The scheduler's position count and the KV cache length agree after every step.
                assert core.runner.caches[rid].get_seq_length() == seq.num_computed
                assert seq.num_computed == len(seq.req.prompt_ids) + len(seq.output_ids) - 1
        assert got == plain
        assert om.store.pinned_count() == 0
    finally:
        om.close()


def test_failed_read_fails_only_its_requests_and_frees_every_slot(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.25, offload="disk", warm_start=False)
    )
    try:
        fetch = om.transfers.tier._fetch
        bad = {"key": None}

        def flaky(layer: int, e: int, into: torch.Tensor | None = None) -> torch.Tensor:
            if bad["key"] is None:
                bad["key"] = (layer, e)  # the first expert read of the run fails once
                raise OSError(errno.EIO, "Input/output error (injected)")
            return fetch(layer, e, into)

        om.transfers.tier._fetch = flaky  # type: ignore[method-assign]
        core = EngineCore.for_model(om, CoreLimits(max_running=8, max_model_len=512))
        prompts = _prompts(om.config.vocab_size, [5, 7, 9, 11])
        outs = complete(
            core,
            [core.local_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts],
        )
        failed = [c for c in outs if c.finish_reason == "error"]
        assert failed and all(
            "could not be loaded" in c.error and "Input/output error" in c.error for c in failed
        )
        settle(om)  # loads the failed step had started may still be landing
        assert om.store.pinned_count() == 0, "a failed read left slots pinned"
        assert om.transfers.pending() == 0
        # The survivors are exact, and the next request succeeds.
        for p, c in zip(prompts, outs):
            if c.finish_reason != "error":
                assert (
                    c.token_ids
                    == generate(om, p, SamplingParams(max_tokens=6, ignore_eos=True)).token_ids
                )
        after = generate(om, prompts[0], SamplingParams(max_tokens=6, ignore_eos=True))
        assert after.error is None and len(after.token_ids) == 6
    finally:
        om.close()


def test_exception_during_expert_compute_releases_leases(tiny_ckpt, caplog) -> None:
    om = load_model(tiny_ckpt("olmoe"), EngineConfig(cache_fraction=0.5))
    try:
        real = om.executor.expert
        calls = {"n": 0}

        def boom(key: int, x: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected compute failure")
            return real(key, x)

        om.executor.expert = boom  # type: ignore[method-assign]
        c = generate(om, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        # The request is told the type and an error id; the log has the message and traceback.
        assert (
            c.finish_reason == "error"
            and "RuntimeError" in (c.error or "")
            and "injected" not in (c.error or "")
        )
        eid = (c.error or "").rsplit("error id ", 1)[1].rstrip(")")
        assert any(
            eid in r.getMessage()
            and r.exc_info
            and "injected compute failure" in str(r.exc_info[1])
            for r in caplog.records
        )
        settle(om)  # loads the failed layer had started may still be landing
        assert om.store.pinned_count() == 0
    finally:
        om.close()


def test_concurrent_eviction_never_breaks_an_exact_plan(tiny_ckpt) -> None:
    """A thread that keeps prefetching random experts (evicting others) while layers plan and
    run: fetch-all output must stay exact, so nothing a plan counted on was evicted."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.25, offload="ram"))
    try:
        prompt = _prompts(om.config.vocab_size, [10])[0]
        plain = generate(om, prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
        stop = threading.Event()
        rng = random.Random(1)

        def churn() -> None:
            while not stop.is_set():
                layer = rng.choice(om.moe_layers)
                om.transfers.submit(layer, rng.randrange(om.num_experts), "demand")

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        try:
            for _ in range(3):
                c = generate(om, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
                assert c.error is None and c.token_ids == plain, c.error
        finally:
            stop.set()
            t.join(5)
        assert om.stats.snapshot()["evictions"] > 0
    finally:
        om.close()


def test_prefetch_protection_used_and_wasted(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.25, warm_start=False))
    try:
        store, tr = om.store, om.transfers
        layer = om.moe_layers[0]
        t = tr.submit(layer, 3, "prefetch", protect=True)
        assert t is not None
        t.done.wait(5)
        key = tr.key(layer, 3)
        assert store.is_resident(key) and store.is_protected(key)
        # Protected prefetches are not evicted by other prefetches, only by demand loads.
        for e in range(om.num_experts):
            tr.submit(om.moe_layers[1], e, "prefetch")
        deadline = threading.Event()
        deadline.wait(0.5)
        assert store.is_resident(key)
        with store.lease() as lease, store.lock:  # a plan uses it: the prediction paid off
            lease.pin(key)
            store.touch(key)
        assert not store.is_protected(key)
        t2 = tr.submit(layer, 4, "prefetch", protect=True)
        t2.done.wait(5)
        for _ in range(store.protect_ticks):
            store.tick()  # never used: the protection expires
        s = om.stats.snapshot()
        assert (s["prefetch_issued"], s["prefetch_used"], s["prefetch_wasted"]) == (2, 1, 1)
    finally:
        om.close()


def test_routing_bus_has_many_listeners(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("qwen2_moe"), EngineConfig())
    try:
        seen_a, seen_b = [], []
        off_a = om.bus.subscribe(
            lambda ev: seen_a.append((ev.layer, ev.ids.shape[0], ev.step.spans))
        )
        om.bus.subscribe(lambda ev: seen_b.append(ev.layer))
        core = EngineCore.for_model(om, CoreLimits(max_running=4, max_model_len=256))
        for p in _prompts(om.config.vocab_size, [3, 4]):
            core.add(core.local_request(p, SamplingParams(max_tokens=2, ignore_eos=True)))
        core.step()
        assert [layer for layer, _, _ in seen_a] == om.moe_layers == seen_b
        assert all(rows == 7 and spans == ((0, 3), (3, 7)) for _, rows, spans in seen_a)
        off_a()
        core.step()
        assert len(seen_a) == len(om.moe_layers) and len(seen_b) == 2 * len(om.moe_layers)
    finally:
        om.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offload,fraction", SETTINGS)
def test_embedded_model_batched_equals_solo(offload: str, fraction: float) -> None:
    from models import EMBEDDED_TARGET

    om = load_model(EMBEDDED_TARGET, EngineConfig(cache_fraction=fraction, offload=offload))
    try:
        _batched_equals_alone(om)
    finally:
        om.close()


@pytest.mark.parametrize(
    "arch", ["mixtral", "qwen3_moe"]
)  # transformers' packed forward, and the lean one
def test_a_prompt_longer_than_the_prefill_budget_runs_in_chunks(tiny_ckpt, arch: str) -> None:
    """A lone request whose prompt takes several steps: the chunks before the last keep no logits
    (an empty row list, which once failed the request with an IndexError), and the tokens equal
    a run with the whole prompt in one step."""
    om = load_model(tiny_ckpt(arch), EngineConfig())
    try:
        prompt = _prompts(om.config.vocab_size, [20])[0]
        whole = generate(om, prompt, SamplingParams(max_tokens=4, ignore_eos=True)).token_ids
        core = EngineCore.for_model(
            om, CoreLimits(max_running=1, prefill_token_budget=8, max_model_len=1024)
        )
        chunked = complete(
            core, [core.local_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))]
        )[0]
        assert chunked.error is None, chunked.error
        assert chunked.token_ids == whole
    finally:
        om.close()


def test_output_independent_of_when_other_prompts_join() -> None:
    """The embedded model in bf16, seeded sampling: a request's tokens are the same alone and when
    another request's prompt joins one of its decode steps (prompt rows and decode rows take
    different kernels; a step holding both must not compute the decode rows the prompt's way)."""
    om = load_model(EMBEDDED, EngineConfig())
    try:
        prompt = om.tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
        other = om.tokenizer.encode(
            "<|im_start|>user\nWrite a long story about a cat.<|im_end|>\n<|im_start|>assistant\n"
        )

        def params() -> SamplingParams:
            return SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)

        alone = generate(om, prompt, params()).token_ids
        for delay in range(1, 9):
            core = EngineCore.for_model(om, CoreLimits(max_running=4, max_model_len=512))
            first = core.local_request(prompt, params())
            tokens: list[int] = []
            core.add(first)
            for n in range(100):
                if n == delay:
                    core.add(core.local_request(other, params()))
                for o in core.step():
                    if o.request_id == first.request_id:
                        tokens += o.token_ids
                if not core.has_work():
                    break
            assert tokens == alone, f"a prompt joining at step {delay} changed the output"
    finally:
        om.close()
