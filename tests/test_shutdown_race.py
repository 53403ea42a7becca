"""SIGTERM drain without races: while in-flight requests run, every new connection gets an
answer (503 shutting_down), never "connection refused"; the streams finish whole; the
listener closes only after their last bytes; the process exits 0 with its engine reaped.

The flaky drain of issue 14 ended as soon as the engine's last output arrived, before the
stream had written its final chunks, so uvicorn closed the listener and cancelled the
response (the CancelledError in the log), and a test that happened to be slow to look found
the port closed.  The drain now waits for the HTTP responses themselves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_fixtures import serve

pytestmark = pytest.mark.timeout(900)
# Behind the emulated hdd link (8 ms an expert load, at a quarter of the experts resident) the in-flight
# request takes seconds of sleeping on loads (480 tokens: about 7 s), so the drain lasts long enough to be
# observed whatever the machine's speed or load (the slow test drains 20 times).
N, TOKENS = 1, 480
LONG = {
    "model": "tiny",
    "prompt": "Hello",
    "max_tokens": TOKENS,
    "n": N,
    "stream": True,
    "ignore_eos": True,
    "temperature": 0,
}


def _gone_or_zombie_reaped(pid: int | None) -> bool:
    return pid is not None and not Path(f"/proc/{pid}").exists()


def _drain_cycle(model: Path, log: Path) -> None:
    with serve(
        [
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--drain-timeout",
            "60",
            "--max-running",
            "1",
            "--cache-fraction",
            "0.25",
            "--offload",
            "disk",
            "--link",
            "hdd",
        ],
        log,
    ) as srv:
        engine_pid = srv.engine_pid()
        result: dict[str, object] = {}
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", srv.v1 + "/completions", json=LONG, timeout=120) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
                result["events"] = events
                result["done_at"] = time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.killpg(srv.proc.pid, signal.SIGTERM)  # front end AND engine get it
        checks = 0
        with httpx.Client(timeout=10) as hc:
            while t.is_alive():  # for the whole drain: answered, and answered 503
                h = hc.get(srv.base_url + "/health", headers={"connection": "close"})
                assert h.status_code == 503 and h.json()["status"] == "draining"
                if checks % 5 == 0:
                    r = hc.post(
                        srv.v1 + "/completions",
                        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                        headers={"connection": "close"},
                    )
                    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
                checks += 1
                time.sleep(0.05)
        t.join()
        assert checks >= 3, "the stream ended before the drain could be observed"
        events = result["events"]
        assert isinstance(events, list) and events[-1] == "[DONE]"
        finals = [
            c["finish_reason"]
            for e in events[:-1]
            for c in json.loads(e)["choices"]
            if c["finish_reason"]
        ]
        assert finals == ["length"] * N
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - float(result["done_at"]) < 5  # type: ignore[arg-type]
        assert _gone_or_zombie_reaped(engine_pid)
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]


@pytest.mark.slow  # CI's 10 minutes: the soak and test_server_lifecycle's process-group SIGTERM drain in CI
def test_sigterm_drain(tiny_ckpt, tmp_path: Path) -> None:
    _drain_cycle(tiny_ckpt(), tmp_path / "log")


def test_idle_shutdown_under_1s(tiny_ckpt, tmp_path: Path) -> None:
    with serve(
        ["--model", str(tiny_ckpt()), "--served-model-name", "tiny"], tmp_path / "log"
    ) as srv:
        engine_pid = srv.engine_pid()
        assert (
            httpx.post(
                srv.v1 + "/completions",
                json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                timeout=30,
            ).status_code
            == 200
        )
        t0 = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(10) == 0
        took = time.monotonic() - t0
        assert took < 1.0, took
        assert _gone_or_zombie_reaped(engine_pid)


@pytest.mark.slow
def test_sigterm_drain_20_times_with_cpu_hog(tiny_ckpt, tmp_path: Path) -> None:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(20):
            _drain_cycle(tiny_ckpt(), tmp_path / f"log{i}")
    finally:
        hog.kill()
        hog.wait()
