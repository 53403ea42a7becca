"""EleutherAI lm-evaluation-harness gets bitwise the same per-sample loglikelihoods from a server
with every expert resident (`--cache-fraction 1.0`) as from one holding a quarter of them and
reading the rest from disk (`--cache-fraction 0.25 --offload disk`), in bf16 (the tiny checkpoint
stored in bfloat16, served in its own dtype, the default) and in f32: multiple choice,
loglikelihood (answers followed by EOS and not) and rolling loglikelihood, every value and
is-greedy flag compared with == on its bits (no tolerance), and the aggregated metrics too.
Issue 55's acceptance point "lm-eval loglikelihoods identical at cache 1.0 and at cache 0.25 on disk"."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from lm_eval_tasks import MODEL, eos_prone_checkpoint, server_model_args, task_docs, write_tasks
from server_fixtures import RunningServer, serve

pytestmark = pytest.mark.timeout(900)
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
KINDS = ("mc", "ll", "roll")
PLANNED = "moe_offload_memory_planned_bytes"


@pytest.fixture(scope="module", params=list(DTYPES))
def ckpt(request: pytest.FixtureRequest, tiny_ckpt, tmp_path_factory) -> Path:
    src = tiny_ckpt(dtype=DTYPES[request.param]) if request.param != "f32" else tiny_ckpt()
    return eos_prone_checkpoint(src, tmp_path_factory.mktemp(f"lm_eval_{request.param}") / "model")


def _server(ckpt: Path, log: Path, *flags: str) -> AbstractContextManager[RunningServer]:
    # a long wait for readiness: on the shared 2-core machine a start took over 90 s under load
    return serve(
        ["--model", str(ckpt), "--served-model-name", MODEL, *flags], log, ready_timeout=300
    )


@pytest.fixture(scope="module")
def resident(ckpt: Path, tmp_path_factory) -> Iterator[RunningServer]:
    with _server(ckpt, tmp_path_factory.mktemp("full") / "s.log", "--cache-fraction", "1.0") as s:
        yield s


@pytest.fixture(scope="module")
def offloaded(ckpt: Path, tmp_path_factory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("quarter") / "s.log"
    with _server(ckpt, log, "--cache-fraction", "0.25", "--offload", "disk") as s:
        yield s


def _bits(x: Any) -> Any:
    """`x` with every float replaced by its exact hex form (so == is bitwise, -0.0 != 0.0)."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, list | tuple):
        return [_bits(v) for v in x]
    if isinstance(x, dict):
        return {k: _bits(v) for k, v in x.items()}
    return x


def _floats(x: Any) -> int:
    if isinstance(x, float):
        return 1
    return sum(_floats(v) for v in x) if isinstance(x, list | tuple) else 0


def _expert_counters(srv: RunningServer) -> tuple[float, float]:
    """(expert-cache misses summed over layers, evictions) so far."""
    m = srv.metrics()
    misses = sum(v for (name, _), v in m.items() if name == "moe_offload_expert_cache_misses_total")
    return misses, m[("moe_offload_expert_evictions_total", ())]


@pytest.mark.slow
def test_lm_eval_loglikelihoods_bitwise_equal_at_quarter_cache_on_disk(
    ckpt: Path,
    resident: RunningServer,
    offloaded: RunningServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is local: never wait on a hub
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval  # the test extra lm-eval[api]
    from lm_eval.tasks import TaskManager

    # The 0.25 server really holds a quarter of the routed experts (4 of the 16) in its fast tier,
    # the slow tier all of them; the 1.0 server serves all from host RAM (its fast tier is 0 bytes,
    # zero-copy, so its share is checked below by its misses).
    m = offloaded.metrics()
    fast, slow = m[(PLANNED, (("pool", "fast_tier"),))], m[(PLANNED, (("pool", "slow_tier"),))]
    assert 4 * fast == slow > 0, (fast, slow)
    before = {id(s): _expert_counters(s) for s in (resident, offloaded)}

    tasks = write_tasks(ckpt, tmp_path, KINDS)
    tm = TaskManager(include_path=str(tmp_path))
    runs = [
        lm_eval.simple_evaluate(
            model="local-completions",
            model_args=server_model_args(srv.v1, ckpt),
            tasks=tasks,
            task_manager=tm,
            batch_size=1,
            bootstrap_iters=0,
            log_samples=True,
        )
        for srv in (resident, offloaded)
    ]

    # The offloaded server missed and evicted experts during the evaluation; the resident one never.
    (m0, e0), (m1, e1) = (
        tuple(a - b for a, b in zip(_expert_counters(s), before[id(s)], strict=True))
        for s in (resident, offloaded)
    )
    assert m0 == 0 == e0 and m1 > 0 and e1 > 0, (m0, e0, m1, e1)

    docs = task_docs(ckpt)
    # Loglikelihoods each doc asks: one per choice, one per answer, one per text (windows summed).
    want = {"mc": 3 * len(docs["mc"]), "ll": len(docs["ll"]), "roll": len(docs["roll"])}
    for kind, task in zip(KINDS, tasks, strict=True):
        got = [runs[i]["samples"][task] for i in (0, 1)]
        assert [s["doc_id"] for s in got[0]] == [s["doc_id"] for s in got[1]]
        n = 0
        for a, b in zip(*got, strict=True):
            for key in ("resps", "filtered_resps"):
                assert _bits(a[key]) == _bits(b[key]), (task, a["doc_id"], key, a[key], b[key])
            n += _floats(a["filtered_resps"])
        assert n == want[kind], (task, n)  # every request compared, none missing
        assert _bits(runs[0]["results"][task]) == _bits(runs[1]["results"][task])
