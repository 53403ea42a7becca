"""The front end's handle on the engine process, and its supervisor.

A reader thread blocks on the engine's output queue and hands each message to the event loop
with `call_soon_threadsafe`, so the loop never blocks on model work or on IPC.  Each HTTP
request registers one asyncio.Queue that receives the RequestOutputs of all its choices.

Supervision: when the engine process dies, every in-flight request gets an EngineFailure, the
child is reaped, and a new engine is started: at once after a minute or more of service, else
after a backoff (1, 2, 4 ... s, one step per death since the last engine that served a minute),
so a crash loop slows down.  Each start gets
fresh queues: a process killed while holding a queue's lock would leave it locked forever.
After `max_restarts` restarts within `restart_window` seconds the client gives up and calls
`on_fatal`, so the server exits non-zero and its own supervisor (systemd, Kubernetes) acts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine import (
    AbortRequest,
    EngineArgs,
    EngineDead,
    EngineOutput,
    EngineReady,
    GenerateRequest,
    RequestOutput,
    Shutdown,
    StatsUpdate,
    engine_main,
    new_error_id,
)
from server.engine_spawn import engine_context
from server.metrics import ServerMetrics

log = logging.getLogger("moe_offload.server")

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# An engine that served this long before it died restarts at once: the backoff is for crash
# loops, not for the first fault after a stretch of good service.
STABLE_S = 60.0
POLL_S = 0.1  # how often the reader thread looks whether a silent engine died


class EngineState(Enum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    DEAD = "dead"  # gave up (restart budget spent, or shut down)


class EngineFailure(Exception):
    """Put on a request's queue when the engine process fails; the request cannot complete.

    `code` is the fault class a client sees: `engine_restarted` when a new engine is on its way
    (retrying later will work), `engine_dead` when the server gives up or shuts down."""

    def __init__(self, message: str, code: str = "engine_dead") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Track:
    queue: asyncio.Queue[RequestOutput | EngineFailure]
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Engine:
    """One incarnation of the engine process with its own queues."""

    gen: int
    proc: Any  # a multiprocessing Process (forkserver's, or spawn's with --no-engine-preload)
    in_q: Any
    out_q: Any
    started: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        """Reap the (dead or killed) child and free the queues' pipes and feeder threads."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        for q in (self.in_q, self.out_q):
            q.cancel_join_thread()  # unread items for a dead reader must not block exit
            q.close()


class EngineClient:
    def __init__(
        self,
        args: EngineArgs,
        metrics: ServerMetrics,
        max_restarts: int = 3,
        restart_window: float = 600.0,
        preload: bool = True,
    ) -> None:
        self.args = args
        self.metrics = metrics
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.state = EngineState.LOADING
        self.error: str | None = None  # why the engine died: one line ending in its error id
        self.error_id: str | None = None
        self.engine_pid: int | None = None
        self.on_fatal: Callable[[], None] | None = None  # set by the server: exit non-zero
        self._reqs: dict[str, _Track] = {}
        self._ctx = engine_context(preload)  # forkserver with the engine's imports done once
        self._engine: _Engine | None = None
        self._gen = 0
        self._restarts: list[float] = []  # monotonic times of restarts inside the window
        # Deaths since the last engine that served STABLE_S: the backoff's step. (Counting every
        # restart in the window instead made a server with four faults in ten minutes, each
        # followed by minutes of service, wait 16 to 30 s to restart an engine; the soak.)
        self._quick_deaths = 0
        self._restart_at: float | None = None  # when the pending restart spawns
        self._restart_handle: asyncio.TimerHandle | None = None
        self._load_seconds = 5.0  # last measured start-to-ready time, for Retry-After
        self._ready_at = 0.0  # when the current engine said ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()

    def _spawn(self) -> None:
        self._restart_handle = self._restart_at = None
        if self._closing:
            return
        self._gen += 1
        eng = _Engine(self._gen, None, self._ctx.Queue(), self._ctx.Queue())
        eng.proc = self._ctx.Process(
            target=engine_main,
            args=(self.args, eng.in_q, eng.out_q),
            name="moe-offload-engine",
            daemon=True,
        )
        # Ignored signals stay ignored across exec and fork: the child (and the forkserver, which
        # the first start launches) is immune from its first instruction, even when a SIGTERM to
        # the whole process group arrives during startup.
        saved = None
        if threading.current_thread() is threading.main_thread():
            saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            eng.proc.start()
        finally:
            for s, h in (saved or {}).items():
                signal.signal(s, h)
        self._engine = eng
        if self.state is not EngineState.RESTARTING:
            self.state = EngineState.LOADING
        threading.Thread(
            target=self._read_loop, args=(eng,), name=f"engine-reader-{eng.gen}", daemon=True
        ).start()

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self._restart_handle is not None:
            self._restart_handle.cancel()
        eng, self._engine = self._engine, None
        if eng is None:
            return
        if eng.proc.is_alive() and self.state is EngineState.READY:
            eng.in_q.put(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, eng.proc.join, timeout)
        eng.release()  # an engine still loading has no work to finish: killed (it reads no input yet)
        self.state = EngineState.DEAD

    def retry_after(self) -> str:
        """Seconds until the engine should accept work: the pending backoff plus a load."""
        now = time.monotonic()
        if self.state is EngineState.RESTARTING and self._restart_at is not None:
            wait = self._restart_at - now + self._load_seconds
        elif self._engine is not None and self.state in (
            EngineState.LOADING,
            EngineState.RESTARTING,
        ):
            wait = self._engine.started + self._load_seconds - now
        else:
            wait = 1.0
        return str(max(1, math.ceil(wait)))

    # -- requests ------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._reqs)

    def submit(self, reqs: list[GenerateRequest]) -> asyncio.Queue[RequestOutput | EngineFailure]:
        assert self._engine is not None and self.state is EngineState.READY
        q: asyncio.Queue[RequestOutput | EngineFailure] = asyncio.Queue()
        for r in reqs:
            self._reqs[r.request_id] = _Track(q)
            self._engine.in_q.put(r)  # non-blocking: a feeder thread pickles and writes
        return q

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop a request; its final "abort" output still comes back."""
        if (
            request_id in self._reqs
            and self.state is EngineState.READY
            and self._engine is not None
        ):
            self._engine.in_q.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        for rid in list(self._reqs):
            self.abort(rid)

    # -- engine -> loop ------------------------------------------------------------
    def _read_loop(self, eng: _Engine) -> None:
        assert self._loop is not None
        while True:
            try:
                msg: EngineOutput = eng.out_q.get(timeout=POLL_S)
            except queue.Empty:
                if eng.proc.is_alive():
                    continue
                msg = EngineDead(f"engine process exited (code {eng.proc.exitcode})")
            except (EOFError, OSError, ValueError) as e:
                msg = EngineDead(f"engine output channel broke: {e}")
            try:
                self._loop.call_soon_threadsafe(self._on_message, eng.gen, msg)
            except RuntimeError:  # loop closed: the server is gone
                return
            if isinstance(msg, EngineDead):
                return

    def _on_message(self, gen: int, msg: EngineOutput) -> None:
        if self._engine is None or gen != self._engine.gen:
            return  # from an engine already replaced or closed
        if isinstance(msg, RequestOutput):
            self._on_output(msg)
        elif isinstance(msg, StatsUpdate):
            self.metrics.running.set(msg.num_running)
            self.metrics.waiting.set(msg.num_waiting)
            self.metrics.engine.snapshot = msg.engine
        elif isinstance(msg, EngineReady):
            self.state, self.engine_pid = EngineState.READY, msg.pid
            self._ready_at = time.monotonic()
            self._load_seconds = self._ready_at - self._engine.started
            log.info(
                "engine ready (pid %d, max_model_len %d, %.1f s)",
                msg.pid,
                msg.max_model_len,
                self._load_seconds,
            )
            log.info("%s", "\n".join(msg.plan))  # the load plan (engine/plan/load_plan.py)
        elif isinstance(msg, EngineDead):
            self._on_death(msg.error)

    def _on_death(self, error: str) -> None:
        assert self._engine is not None
        was_ready = self.state is EngineState.READY
        # One line for clients (/health, 503 bodies); the engine logged its traceback under the
        # same id, or, for a process that simply vanished, this log line is all there is.
        found = re.search(r"error id (err-[0-9a-f]+)", error)
        self.error_id = found.group(1) if found else new_error_id()
        self.error = error if found else f"{error} (error id {self.error_id})"
        error = self.error
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < self.restart_window]
        first_load_failed = not was_ready and self.engine_pid is None
        restarts = (
            not self._closing and not first_load_failed and len(self._restarts) < self.max_restarts
        )
        self._fail_in_flight(error, "engine_restarted" if restarts else "engine_dead")
        eng, self._engine = self._engine, None
        eng.release()  # reaps: the child is dead or killed here, so join returns at once
        if self._closing:
            self.state = EngineState.DEAD
            return
        if first_load_failed:
            log.error(
                "engine failed to start: %s", error
            )  # a first load that fails will fail again
        elif len(self._restarts) < self.max_restarts:
            stable = was_ready and now - self._ready_at >= STABLE_S
            self._quick_deaths = 0 if stable else self._quick_deaths + 1
            step = min(self._quick_deaths - 1, len(BACKOFF_S) - 1)
            delay = 0.0 if stable else BACKOFF_S[step]
            self._restarts.append(now)
            self.state, self._restart_at = EngineState.RESTARTING, now + delay
            log.error(
                "engine died: %s; restart %d of %d in %.0f s",
                error,
                len(self._restarts),
                self.max_restarts,
                delay,
            )
            assert self._loop is not None
            self._restart_handle = self._loop.call_later(delay, self._spawn)
            return
        else:
            log.error(
                "engine died: %s; %d restarts within %.0f s spent: giving up",
                error,
                self.max_restarts,
                self.restart_window,
            )
        self.state = EngineState.DEAD
        if self.on_fatal is not None:
            self.on_fatal()

    def _fail_in_flight(self, error: str, code: str) -> None:
        for t in self._reqs.values():
            t.queue.put_nowait(EngineFailure(error, code))
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
