"""Front-end limits: oversized bodies are refused early (413) without stalling /health or
growing memory; slow clients hold no one up; requests that cannot be honoured get a 400."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest
from server_fixtures import RunningServer

pytestmark = pytest.mark.timeout(240)
MODEL = "tiny"
MSGS = [{"role": "user", "content": "Hello"}]
MB = 1024 * 1024


@pytest.fixture(scope="module")
def srv(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # shared (tests/conftest.py): started once per worker


def _addr(srv: RunningServer) -> tuple[str, int]:
    host, port = srv.base_url.rsplit("//", 1)[1].split(":")
    return host, int(port)


def _poll_health(
    srv: RunningServer,
    stop: threading.Event,
    out: list[tuple[int, bool]],
    running: threading.Event | None = None,
) -> None:
    """Until `stop`: GET /health; for each answer, (status, whether `running` was still set)."""
    with httpx.Client(timeout=30) as hc:
        while not stop.is_set():
            status = hc.get(srv.base_url + "/health").status_code
            out.append((status, running is not None and running.is_set()))
            time.sleep(0.02)


@contextmanager
def _generating(srv: RunningServer) -> Iterator[threading.Event]:
    """A streamed generation of 2 prompts x 16 choices x 480 tokens (seconds of engine work) that
    has started decoding; yields an event that stays set until its last chunk arrives."""
    body = {
        "model": MODEL,
        "prompt": ["Hello", "Mixture-of-Experts"],
        "max_tokens": 480,
        "n": 16,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    started, running = threading.Event(), threading.Event()
    events: list[str] = []

    def read() -> None:
        running.set()
        try:
            with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    events.append(f"{r.status_code} {r.read()[:300]!r}")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        finally:
            running.clear()
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert started.wait(60) and running.is_set(), events[-3:]
        yield running
    finally:
        reader.join(120)
    assert events[-1] == "[DONE]" and not reader.is_alive()


def _upload(srv: RunningServer, size: int, chunked: bool) -> tuple[int, float]:
    """POST `size` bytes (sent in 64 KiB pieces) on a raw socket; (status, seconds to the answer)."""
    sock = socket.create_connection(_addr(srv), timeout=30)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    t0 = time.perf_counter()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
    )
    piece = b'{"prompt": "' + b"a" * (64 * 1024 - 12)
    got: dict[str, object] = {}

    def read() -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                break
            data += more
        got["t"], got["head"] = time.perf_counter() - t0, data

    reader = threading.Thread(target=read)
    reader.start()
    sent = 0
    try:
        while sent < size and reader.is_alive():
            frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
            sock.sendall(frame)
            sent += len(piece)
    except OSError:
        pass  # the server answered and closed: the rest is never read, as intended
    reader.join(30)
    sock.close()
    head = got["head"]
    assert isinstance(head, bytes) and head.startswith(b"HTTP/1.1 "), head
    return int(head.split()[1]), float(got["t"])  # type: ignore[arg-type]


def test_health_answers_while_an_upload_is_half_sent(srv: RunningServer) -> None:
    """The body is read without holding the event loop: /health answers while an upload (under
    the limit, so the server waits for the rest) is still being sent and has had no answer."""
    with socket.create_connection(_addr(srv), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b'{"prompt": "' + b"a" * MB
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        r = httpx.get(srv.base_url + "/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        readable, _, _ = select.select([sock], [], [], 0)
        assert not readable, "the half-sent upload was answered before /health"


@pytest.mark.parametrize("chunked", [False, True])
def test_20mb_body_is_413_fast_while_health_answers(srv: RunningServer, chunked: bool) -> None:
    proc = psutil.Process(srv.proc.pid)
    for _ in range(3):  # warm: the first requests allocate for good
        _upload(srv, 20 * MB, chunked)
    base = proc.memory_info().rss
    answers: list[tuple[int, bool]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_health, args=(srv, stop, answers))
    poller.start()
    try:
        while len(answers) < 3 and poller.is_alive():
            time.sleep(0.01)
        for _ in range(3):
            status, seconds = _upload(srv, 20 * MB, chunked)
            assert status == 413 and seconds < 1.0, (status, seconds)
    finally:
        stop.set()
        poller.join()
    assert len(answers) >= 3 and {status for status, _ in answers} == {200}, answers
    assert proc.memory_info().rss < base * 1.10, (base, proc.memory_info().rss)
    r = httpx.post(
        srv.v1 + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30
    )
    assert r.status_code == 200  # the server is fine afterwards


def test_413_is_an_openai_error_object(srv: RunningServer) -> None:
    r = httpx.post(
        srv.v1 + "/completions",
        content=b"x" * (9 * MB),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    assert (
        r.json()["error"]["code"] == "request_too_large"
        and r.json()["error"]["type"] == "invalid_request_error"
    )


def test_slowloris_holds_no_one_up(srv: RunningServer) -> None:
    socks = []
    try:
        for _ in range(50):  # half-sent headers, trickled
            s = socket.create_connection(_addr(srv), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        for s in socks:
            s.sendall(b"X-Slow: 1\r\n")
        t0 = time.perf_counter()
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
        assert time.perf_counter() - t0 < 0.5
        r = httpx.post(
            srv.v1 + "/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 200
    finally:
        for s in socks:
            s.close()


def test_health_answers_during_generation_and_long_prompts(srv: RunningServer) -> None:
    """The longest text the cheap bound lets through goes to the tokenizer pool, off the loop,
    while a long generation decodes: /health answers throughout, and answered while that
    generation was provably still running (not queued behind it)."""
    n_chars = 512 * 12  # max_model_len x the longest vocabulary entry of the tiny tokenizer
    answers: list[tuple[int, bool]] = []
    stop = threading.Event()
    codes = []
    with _generating(srv) as running:
        poller = threading.Thread(target=_poll_health, args=(srv, stop, answers, running))
        poller.start()
        try:
            with httpx.Client(timeout=60) as hc:
                for _ in range(10):
                    codes.append(
                        hc.post(
                            srv.v1 + "/chat/completions",
                            json={
                                "model": MODEL,
                                "messages": [{"role": "user", "content": "ab " * (n_chars // 3)}],
                                "max_tokens": 1,
                            },
                        ).status_code
                    )
            while not answers and poller.is_alive():
                time.sleep(0.01)
        finally:
            stop.set()
            poller.join()
    assert set(codes) == {400}  # tokenized, then found too long: context_length_exceeded
    assert answers and {status for status, _ in answers} == {200}, answers
    assert any(was_running for _, was_running in answers), "no /health answer before it ended"


def _err(srv: RunningServer, path: str, body: dict) -> dict:
    r = httpx.post(srv.v1 + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_image_and_audio_parts_are_400(srv: RunningServer, part: dict) -> None:
    e = _err(
        srv,
        "/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}],
        },
    )
    assert e["param"] == "messages[0].content[1].type" and part["type"] in e["message"]


def test_unhonourable_fields_are_400_and_unknown_extras_ignored(srv: RunningServer) -> None:
    e = _err(
        srv,
        "/chat/completions",
        {"model": MODEL, "messages": MSGS, "stream_options": {"include_usage": True}},
    )
    assert "stream_options" in e["message"]
    e = _err(
        srv,
        "/completions",
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}, "stream": False},
    )
    assert "stream_options" in e["message"]
    ok = httpx.post(
        srv.v1 + "/chat/completions",
        json={"model": MODEL, "messages": MSGS, "max_tokens": 1, "some_future_field": {"x": 1}},
        timeout=30,
    )
    assert ok.status_code == 200


def test_request_size_limits(srv: RunningServer) -> None:
    e = _err(srv, "/chat/completions", {"model": MODEL, "messages": MSGS * 1025, "max_tokens": 1})
    assert e["param"] == "messages" and "1024" in e["message"]
    e = _err(srv, "/completions", {"model": MODEL, "prompt": ["x"] * 65, "max_tokens": 1})
    assert e["param"] == "prompt"
    e = _err(
        srv, "/completions", {"model": MODEL, "prompt": ["x"] * 16, "n": 16, "max_tokens": 1100}
    )
    assert e["param"] == "max_tokens" and "262144" in e["message"]
    e = _err(srv, "/completions", {"model": MODEL, "prompt": ["x"] * 64, "n": 16, "max_tokens": 1})
    assert e["param"] == "n" and "1024 sequences" in e["message"]  # more than the server ever holds
    e = _err(srv, "/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 17})
    assert e["param"] == "stop"
    e = _err(srv, "/completions", {"model": MODEL, "prompt": "x" * 10_000_00})
    assert e["code"] == "context_length_exceeded"


def test_context_length_error_never_negative(srv: RunningServer) -> None:
    long_chat = [{"role": "user", "content": "The quick brown fox. " * 200}]
    e = _err(srv, "/chat/completions", {"model": MODEL, "messages": long_chat})
    assert e["code"] == "context_length_exceeded" and "-" not in e["message"], e["message"]
    e = _err(srv, "/completions", {"model": MODEL, "prompt": [5] * 500, "max_tokens": 100})
    assert e["code"] == "context_length_exceeded" and "-" not in e["message"]
