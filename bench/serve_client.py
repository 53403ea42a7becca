"""The client side of `python -m bench serve`: stream chat completions from any OpenAI-compatible base URL
on a schedule, and watch the server while it runs (peak RSS of its process tree, gauges from /metrics).

One run is one workload at one arrival rate against one server: every session is a coroutine that sends its
turns at their scheduled times (bench/serve_workload.py), each turn after the previous one finished.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_stats import RequestResult
from bench.serve_workload import Session

# Gauges worth keeping from a server's /metrics: KV, caches, memory, experts, queue depth. This engine's
# are moe_offload_*, llama-server's llamacpp:* (with --metrics), vLLM's vllm:*.
GAUGE_NAMES = re.compile(r"kv|cache|expert|memory|running|waiting|processing|deferred|usage")


@dataclass
class Target:
    """One server to measure: its base URL (without /v1), the model id to send, and, when known, the
    pid of its process tree for RSS and extra fields for the request body."""

    name: str
    base_url: str
    model: str = ""
    pid: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    loads: Any = None  # bench/serve_belady.py's BeladyProbe, for an engine started with --belady


@dataclass
class RunSpec:
    """What every request of a run asks for."""

    output_tokens: int
    ignore_eos: bool = True
    timeout_s: float = 600.0


def discover_model(base_url: str) -> str:
    """The first model id /v1/models lists."""
    body = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()
    return str(body["data"][0]["id"])


async def stream_one(
    client: httpx.AsyncClient, target: Target, messages: list[dict[str, str]], spec: RunSpec
) -> tuple[RequestResult, str]:
    """Send one streaming chat completion; the timings and the reply's text."""
    body: dict[str, Any] = {
        "model": target.model,
        "messages": messages,
        "max_tokens": spec.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if spec.ignore_eos else {}),
        **target.extra_body,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    try:
        url = target.base_url.rstrip("/") + "/v1/chat/completions"
        async with client.stream("POST", url, json=body, timeout=spec.timeout_s) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {detail}"), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if piece:
                        stamps.append(time.perf_counter())
                        text.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}"[:200]), ""
    end = time.perf_counter()
    if not stamps:
        return RequestResult(ok=False, error="no tokens streamed"), ""
    res = RequestResult(
        ok=True,
        ttft=stamps[0] - t0,
        latency=end - t0,
        # Without usage, one streamed chunk is counted as one token.
        output_tokens=int(usage.get("completion_tokens") or len(stamps)),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        itl=[b - a for a, b in zip(stamps, stamps[1:])],
    )
    return res, "".join(text)


async def run_sessions(
    target: Target,
    sessions: list[Session],
    times: list[list[float]],
    spec: RunSpec,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float]:
    """Run every session's turns at their send times; all results and the wall time from the first
    send to the last completion."""
    results: list[RequestResult] = []
    # A new connection per request: a kept-alive one that the server closes while idle (llama-server
    # does after a few seconds) fails the next request sent on it, an error of the client's making.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()

        async def session(s: Session, when: list[float]) -> None:
            for turn, t in enumerate(when):
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                sent = time.perf_counter() - start
                res, reply = await stream_one(client, target, s.messages(turn), spec)
                res.sent = sent
                results.append(res)
                on_done()
                if not res.ok:
                    return  # a failed turn ends its session: the next prompt would lack the reply
                s.record(turn, reply)

        await asyncio.gather(*(session(s, w) for s, w in zip(sessions, times)))
        return results, time.perf_counter() - start


def tree_pids(pid: int) -> list[int]:
    """A process and all its live descendants (empty for a process that is gone)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
        out.append(p)
    return out


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of a process tree."""
    total = 0
    for p in tree_pids(pid):
        try:
            m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{p}/status").read_text())
        except OSError:
            continue
        total += 1024 * int(m[1]) if m else 0
    return total


def tree_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process tree's live processes."""
    total = 0.0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def scrape_gauges(base_url: str) -> dict[str, float]:
    """{name{labels}: value} of the interesting gauges on the server's /metrics ({} when it has none)."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=5)
        if resp.status_code != 200:
            return {}
        out = {}
        for fam in text_string_to_metric_families(resp.text):
            if fam.type == "gauge" and GAUGE_NAMES.search(fam.name):
                for s in fam.samples:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[s.name + (f"{{{labels}}}" if labels else "")] = float(s.value)
        return out
    except (httpx.HTTPError, ValueError):
        return {}


class Watcher:
    """While a run goes: every `period` s, the RSS of the server's process tree and its gauges; keeps
    the peak of each (a gauge's peak is what a pool under load reached)."""

    def __init__(self, target: Target, period: float = 0.25) -> None:
        self.target, self.period = target, period
        self.peak_rss = 0
        self.gauges: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        if self.target.pid is not None:
            self.peak_rss = max(self.peak_rss, tree_rss_bytes(self.target.pid))
        for k, v in scrape_gauges(self.target.base_url).items():
            if not math.isnan(v):
                self.gauges[k] = max(v, self.gauges.get(k, -math.inf))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> Watcher:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
