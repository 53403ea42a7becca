"""The whole API, fuzzed from its own /openapi.json by Schemathesis with all of its checks
(server errors, status codes, content types, response schemas, negative and positive data,
unsupported methods), against one real server; every error body, /health and streamed error
is then searched for internals. Then the poison request of issue 30 and other extreme values
in the documented ranges, while an ordinary request runs beside them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import RunningServer

from bench.api_fuzz import leaks_in, responses_of, run_schemathesis

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny"


@pytest.fixture(scope="module")
def srv(fuzz_server: RunningServer) -> RunningServer:
    return fuzz_server  # shared (tests/conftest.py): started once per worker


def _fuzz(srv: RunningServer, tmp_path: Path, examples: int) -> None:
    pid = srv.engine_pid()
    done = run_schemathesis(srv.base_url, examples, tmp_path / "har.json", timeout=1800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    exchanges = responses_of(tmp_path / "har.json")
    statuses = sorted({s for _, s, _, _ in exchanges})
    print(f"schemathesis: {len(exchanges)} requests, statuses {statuses}")
    assert len(exchanges) >= 5 * examples  # five operations, each fuzzed
    assert not [s for s in statuses if s >= 500], statuses
    assert leaks_in(exchanges) == []
    assert httpx.get(srv.base_url + "/health", timeout=10).json() == {"status": "ready"}
    assert srv.engine_pid() == pid
    assert "Traceback" not in srv.log()  # nothing failed inside either


def test_schemathesis_all_checks(srv: RunningServer, tmp_path: Path) -> None:
    _fuzz(srv, tmp_path, 30)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_schemathesis_all_checks_long(srv: RunningServer, tmp_path: Path) -> None:
    _fuzz(srv, tmp_path, 300)


def test_leak_detector_catches_what_it_must() -> None:
    """The detector itself: the bodies issue 30 found, and ordinary messages it must pass."""
    tb = 'engine loop failed: RuntimeError: x\nTraceback (most recent call last):\n  File "/srv/app/engine/core/engine_core.py", line 74, in step'
    found = leaks_in(
        [
            ("/health", 503, "application/json", json.dumps({"status": "restarting", "error": tb})),
            (
                "/v1/completions",
                200,
                "text/event-stream",
                'data: {"error": {"message": "in engine.worker.sampling.sample"}}',
            ),
            (
                "/v1/completions",
                500,
                "application/json",
                '{"error": {"message": "/opt/venv/lib/python3.11/site-packages/torch"}}',
            ),
        ]
    )
    assert len(found) == 3
    ok = [
        (
            "/v1/completions",
            400,
            "application/json",
            '{"error": {"message": "top_p: Input should be greater than 0", "type": "invalid_request_error"}}',
        ),
        (
            "/health",
            503,
            "application/json",
            '{"status": "restarting", "error": "engine process exited (code -9) (error id err-0123456789abcdef)"}',
        ),
    ]
    assert leaks_in(ok) == []


# -- the poison request and other extremes --------------------------------------------------

POISON = {"prompt": "Hi", "max_tokens": 4, "top_p": 5e-324, "temperature": 1.0}
EXTREMES: list[dict[str, Any]] = [
    POISON,
    {**POISON, "stream": True},
    {**POISON, "n": 16},
    {**POISON, "top_p": 2.2250738585072014e-308},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 5e-324},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-5},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0000001e-5, "top_p": 1e-300},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 2.0, "top_k": 1},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 2.0, "top_k": 2**31},
    {
        "prompt": [0],
        "max_tokens": 8,
        "temperature": 2.0,
        "presence_penalty": 2,
        "frequency_penalty": 2,
    },
    {
        "prompt": "Hi",
        "max_tokens": 8,
        "temperature": 1e-5,
        "presence_penalty": -2,
        "frequency_penalty": -2,
        "min_tokens": 8,
    },
    {"prompt": "Hi", "max_tokens": 4, "temperature": 1.5, "seed": 2**63 - 1, "logprobs": 20},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0, "seed": -(2**70)},
    {"prompt": "Hi", "max_tokens": 4, "temperature": 1e308},
    {"prompt": "Hi", "max_tokens": 4, "top_p": 0},
    {"prompt": "Hi", "max_tokens": 4, "temperature": -1e-308},
    {"prompt": "Hi", "max_tokens": 4, "top_p": 1.0000000000000002},
    {"prompt": "Hi", "max_tokens": 4, "presence_penalty": 2.0000000000000004},
]


def _as_chat(e: dict[str, Any]) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        **{k: v for k, v in e.items() if k not in ("prompt", "logprobs")},
    }
    return {**body, "logprobs": True, "top_logprobs": e["logprobs"]} if "logprobs" in e else body


CHAT_EXTREMES = [_as_chat(e) for e in EXTREMES[:13]]


def test_poison_and_extremes_fail_nobody_else(srv: RunningServer) -> None:
    pid = srv.engine_pid()
    ordinary = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=srv.v1, timeout=120) as hc:
        solo = hc.post("/completions", json=ordinary).json()["choices"][0]["text"]

        def send(path_body: tuple[str, dict[str, Any]]) -> httpx.Response:
            return hc.post(path_body[0], json={"model": MODEL, **path_body[1]})

        with ThreadPoolExecutor(8) as pool:
            beside = pool.submit(send, ("/completions", ordinary))
            answers = list(
                pool.map(
                    send,
                    [("/completions", e) for e in EXTREMES]
                    + [("/chat/completions", e) for e in CHAT_EXTREMES],
                )
            )
            together = beside.result()
        for body, r in zip(EXTREMES + CHAT_EXTREMES, answers):
            assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
            if r.status_code == 400:
                assert (
                    r.json()["error"]["type"] == "invalid_request_error"
                    and r.json()["error"]["param"]
                ), r.text
            elif body.get("stream"):
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[
                    -500:
                ]
            else:
                assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]), (
                    r.text[:300]
                )
        assert [b for b, r in zip(EXTREMES, answers) if r.status_code == 400] == EXTREMES[
            13:
        ]  # only the out-of-range ones
        assert together.status_code == 200 and together.json()["choices"][0]["text"] == solo
    assert httpx.get(srv.base_url + "/health", timeout=10).json() == {"status": "ready"}
    assert srv.engine_pid() == pid
    assert "Traceback" not in srv.log()
