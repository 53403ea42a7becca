"""`python -m bench serve` (bench/serve*.py): arrival schedules, percentile and goodput maths, the
workload builders, and one run end to end against a tiny fake OpenAI server started in-process."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from bench.serve import main
from bench.serve_client import tree_cpu_seconds, tree_rss_bytes
from bench.serve_process import free_port
from bench.serve_stats import RequestResult, meets_slo, percentile, summarize
from bench.serve_workload import (
    Words,
    agent_workload,
    arrivals,
    chat_workload,
    parse_rates,
    schedule,
)

# -- arrivals -------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_asked_mean_gap_and_are_seeded() -> None:
    times = arrivals(4000, 2.0, "poisson", seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)  # mean 1/rate
    cv = math.sqrt(sum((g - 0.5) ** 2 for g in gaps) / len(gaps)) / 0.5
    assert cv == pytest.approx(1.0, rel=0.1)  # exponential: std == mean
    assert arrivals(50, 2.0, seed=1) == times[:50] and arrivals(50, 2.0, seed=2) != times[:50]


def test_constant_and_infinite_rates() -> None:
    assert arrivals(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrivals(3, 0.0)
    with pytest.raises(ValueError):
        arrivals(3, 1.0, "bursty")
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, math.inf]
    with pytest.raises(ValueError):
        parse_rates("1,-2")


# -- statistics ---------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0, math.nan]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert math.isnan(percentile([], 50))


def test_tpot_goodput_and_throughput() -> None:
    fast = RequestResult(ok=True, ttft=0.2, latency=1.2, output_tokens=11, itl=[0.1] * 10)
    slow_first = RequestResult(ok=True, ttft=2.0, latency=3.0, output_tokens=11, itl=[0.1] * 10)
    slow_tokens = RequestResult(ok=True, ttft=0.1, latency=5.1, output_tokens=11, itl=[0.5] * 10)
    failed = RequestResult(ok=False, error="HTTP 503")
    assert fast.tpot == pytest.approx(0.1) and slow_tokens.tpot == pytest.approx(0.5)
    assert meets_slo(fast, 1.0, 0.2) and not meets_slo(slow_first, 1.0, 0.2)
    assert not meets_slo(slow_tokens, 1.0, 0.2) and meets_slo(slow_tokens, 1.0, None)
    assert not meets_slo(failed, None, None)
    s = summarize([fast, slow_first, slow_tokens, failed], duration=4.0, slo_ttft=1.0, slo_tpot=0.2)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["output_throughput"] == pytest.approx(33 / 4)
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["goodput"] == pytest.approx(1 / 4) and s["slo_attained"] == pytest.approx(1 / 4)
    assert s["p50_ttft_ms"] == pytest.approx(200) and s["p50_tpot_ms"] == pytest.approx(100)
    assert s["p99_itl_ms"] == pytest.approx(500)


# -- workloads ---------------------------------------------------------------------------


def test_chat_prompts_are_distinct_and_sized_in_words() -> None:
    words = Words(" ".join(f"w{i}" for i in range(1000)), seed=3)
    sessions = chat_workload(words, 5, 12)
    users = [s.messages(0)[-1]["content"] for s in sessions]
    assert len(set(users)) == 5 and all(len(u.split()) == 12 + 3 for u in users)
    assert all(s.system is None and len(s.users) == 1 for s in sessions)


def test_agent_sessions_share_the_system_prompt_and_grow_their_history() -> None:
    words = Words(" ".join(f"w{i}" for i in range(1000)))
    sessions = agent_workload(words, sessions=3, turns=2, system_words=50, turn_words=7)
    assert len({s.system for s in sessions}) == 1 and "read_file" in (sessions[0].system or "")
    s = sessions[0]
    first = s.messages(0)
    s.record(0, "a reply")
    second = s.messages(1)
    assert second[: len(first)] == first  # the next prompt extends the last one
    assert second[len(first)] == {"role": "assistant", "content": "a reply"}
    assert sessions[1].users[0] != s.users[0]  # distinct suffixes


def test_schedule_gives_each_session_its_turns_in_order() -> None:
    sessions = agent_workload(
        Words("a b c d e f"), sessions=2, turns=3, system_words=1, turn_words=1
    )
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert schedule(sessions, times) == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    with pytest.raises(ValueError):
        schedule(sessions, times[:5])


def test_process_tree_rss_and_cpu_count_this_process() -> None:
    assert tree_rss_bytes(os.getpid()) > 10 * 2**20
    assert tree_cpu_seconds(os.getpid()) > 0
    assert tree_rss_bytes(2**22 + 12345) == 0  # no such process


# -- end to end ---------------------------------------------------------------------------


def fake_openai(tokens_delay: float = 0.002) -> FastAPI:
    """Streams max_tokens one-word chunks with usage; counts the agent history it is sent."""
    app = FastAPI()
    app.state.seen = []

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        text = "# TYPE fake_kv_blocks_used gauge\nfake_kv_blocks_used 7\n"
        return PlainTextResponse(text)

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> StreamingResponse:
        body = await req.json()
        app.state.seen.append(body)
        n = body["max_tokens"]

        async def events() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(tokens_delay)
                delta = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
                yield f"data: {json.dumps(delta)}\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_url() -> Iterator[tuple[str, FastAPI]]:
    app = fake_openai()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(10)


def test_a_run_against_a_fake_server_writes_the_report(fake_url, tmp_path: Path) -> None:
    url, app = fake_url
    out = tmp_path / "serve.md"
    argv = ["--base-url", url, "--server-pid", str(os.getpid()), "--rates", "20,inf"]
    argv += ["--requests", "6", "--sessions", "3", "--turns", "2", "--output-tokens", "5"]
    argv += ["--warmup", "1", "--system-words", "20", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert not report["args"]["model"].startswith("/")  # no machine path in a report
    assert {(r["workload"], r["rate"]) for r in rows} == {
        (w, r) for w in ("chat", "agent") for r in (20.0, "inf")
    }
    for r in rows:
        assert r["failed"] == 0 and r["output_tokens"] == 5 * r["requests"]
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] < 5000
        assert r["p50_tpot_ms"] > 0 and r["peak_rss_bytes"] > 0
        assert r["gauges_peak"] == {"fake_kv_blocks_used": 7.0}
    assert sum(r["requests"] for r in rows if r["workload"] == "agent") == 2 * 3 * 2
    # The last turn of an agent session carries the first turn and the reply streamed to it.
    agent = [b for b in app.state.seen if b["messages"][0]["role"] == "system"]
    last = max(agent, key=lambda b: len(b["messages"]))
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "user"]
    assert last["messages"][2]["content"] == " t0 t1 t2 t3 t4"
    assert all(b["ignore_eos"] and b["stream"] for b in app.state.seen)
    # Each rate and the warm-up get their own text: no run finds its prompts in a server's cache.
    chats = {b["messages"][0]["content"] for b in app.state.seen if len(b["messages"]) == 1}
    assert len(chats) == 1 + 6 * 2
    assert "| agent | inf | server |" in out.read_text() and out.with_suffix(".png").exists()
