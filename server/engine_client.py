"""The front end's handle on the engine process.

A reader thread blocks on the engine's output queue and hands each message to the event loop
with `call_soon_threadsafe`, so the loop never blocks on model work or on IPC.  Each HTTP
request registers one asyncio.Queue that receives the RequestOutputs of all its choices.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from enum import Enum

from engine.core.engine_process import EngineArgs, engine_main
from engine.core.messages import AbortRequest, EngineDead, EngineOutput, EngineReady, GenerateRequest, RequestOutput, Shutdown, StatsUpdate
from server.metrics import ServerMetrics

log = logging.getLogger("moe_offload.server")


class EngineState(Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"


class EngineFailure(Exception):
    """Put on a request's queue when the engine process fails; the request cannot complete."""


@dataclass
class _Track:
    queue: asyncio.Queue[RequestOutput | EngineFailure]
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None


class EngineClient:
    def __init__(self, args: EngineArgs, metrics: ServerMetrics) -> None:
        self.args = args
        self.metrics = metrics
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.engine_pid: int | None = None
        self._reqs: dict[str, _Track] = {}
        ctx = mp.get_context("spawn")
        self._in: mp.Queue = ctx.Queue()
        self._out: mp.Queue = ctx.Queue()
        self._proc = ctx.Process(target=engine_main, args=(args, self._in, self._out), name="moe-offload-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._closing = False

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # Ignored signals stay ignored across exec: the child is immune from its first
        # instruction, even when a SIGTERM to the whole process group arrives during startup.
        saved = None
        if threading.current_thread() is threading.main_thread():
            saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._proc.start()
        finally:
            for s, h in (saved or {}).items():
                signal.signal(s, h)
        self._reader = threading.Thread(target=self._read_loop, name="engine-reader", daemon=True)
        self._reader.start()

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self._proc.is_alive():
            self._in.put(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2)

    # -- requests ------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._reqs)

    def submit(self, reqs: list[GenerateRequest]) -> asyncio.Queue[RequestOutput | EngineFailure]:
        q: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        for r in reqs:
            self._reqs[r.request_id] = _Track(q)
            self._in.put(r)  # non-blocking: a feeder thread pickles and writes
        return q

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop a request; its final "abort" output still comes back."""
        if request_id in self._reqs and self.state is not EngineState.DEAD:
            self._in.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        for rid in list(self._reqs):
            self.abort(rid)

    # -- engine -> loop ------------------------------------------------------------
    def _read_loop(self) -> None:
        assert self._loop is not None
        while True:
            try:
                msg: EngineOutput = self._out.get(timeout=0.5)
            except queue.Empty:
                if self._proc.is_alive():
                    continue
                msg = EngineDead(f"engine process exited (code {self._proc.exitcode})")
            except (EOFError, OSError) as e:
                msg = EngineDead(f"engine output channel broke: {e}")
            try:
                self._loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # loop closed: the server is gone
                return
            if isinstance(msg, EngineDead):
                return

    def _on_message(self, msg: EngineOutput) -> None:
        if isinstance(msg, RequestOutput):
            self._on_output(msg)
        elif isinstance(msg, StatsUpdate):
            self.metrics.running.set(msg.num_running)
            self.metrics.waiting.set(msg.num_waiting)
            self.metrics.engine.snapshot = msg.engine
        elif isinstance(msg, EngineReady):
            self.state, self.engine_pid = EngineState.READY, msg.pid
            log.info("engine ready (pid %d, max_model_len %d)", msg.pid, msg.max_model_len)
        elif isinstance(msg, EngineDead):
            self.state, self.error = EngineState.DEAD, msg.error
            if not self._closing:
                log.error("engine died: %s", msg.error)
            for rid, t in self._reqs.items():
                t.queue.put_nowait(EngineFailure(msg.error))
                self.metrics.finished.labels("error").inc()
            self._reqs.clear()
            self.metrics.running.set(0)
            self.metrics.waiting.set(0)

    def _on_output(self, o: RequestOutput) -> None:
        t = self._reqs.get(o.request_id)
        if t is None:
            return
        m, now = self.metrics, time.monotonic()
        if o.queue_seconds is not None:
            m.queue_time.observe(o.queue_seconds)
            if o.finish_reason != "abort" or o.token_ids:
                m.prompt_tokens.inc(o.num_prompt_tokens)
        if o.token_ids:
            m.generation_tokens.inc(len(o.token_ids))
            if t.first_token is None:
                t.first_token = now
                m.ttft.observe(now - t.arrival)
            elif t.last_token is not None:
                for _ in o.token_ids:
                    m.itl.observe((now - t.last_token) / len(o.token_ids))
            t.last_token = now
        if o.finish_reason is not None:
            m.finished.labels(o.finish_reason).inc()
            m.e2e.observe(now - t.arrival)
            del self._reqs[o.request_id]
        t.queue.put_nowait(o)
