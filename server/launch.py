"""Run the app under uvicorn with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import os
import socket
import sys
from types import FrameType
from typing import NoReturn

import uvicorn
from fastapi import FastAPI

from server.app import drain
from server.limits import RequestCounter
from server.state import ServerState

log = logging.getLogger("moe_offload.server")


class DrainingServer(uvicorn.Server):
    """uvicorn stops listening at once on a signal; we first keep answering (503 for new
    requests) while in-flight requests finish, then exit with status 0.  A second signal
    forces the exit."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        requests: RequestCounter,
        drain_timeout: float,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.requests = requests
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None
        state.client.on_fatal = self._fatal

    def _fatal(self) -> None:
        """The engine's restart budget is spent: stop serving and exit non-zero."""
        self.exit_code = 1
        self.state.draining = True
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the
        # process would die by the signal instead of exiting cleanly after the drain.
        if self._drain_task is not None or self._loop is None:
            self.should_exit = True
            self.force_exit = self._drain_task is not None
            return
        log.info("signal %d: draining", sig)
        self._drain_task = True  # type: ignore[assignment]  # mark at once; the task starts on the loop
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.requests, self.drain_timeout)
        finally:
            self.should_exit = True


def run_server(
    app: FastAPI, host: str, port: int, drain_timeout: float, log_level: str = "info"
) -> NoReturn:
    """Serve until drained (exit 0) or the engine is beyond repair (exit 1); ends the process."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on"
    )
    server = DrainingServer(config, app.state.server, app.state.requests, drain_timeout)
    freeze_startup_objects()
    server.run()
    exit_now(server.exit_code)


def freeze_startup_objects() -> None:
    """Move every object alive now (the imports of torch and transformers, the tokenizer: about
    400,000 of them) out of the garbage collector's reach for good. They live as long as the
    process, yet a full (generation 2) collection walks them all, 235 ms on the 2-core machine,
    while the event loop, and so /health, waits: in a 120 s soak without this the front end made
    one, of 544 ms, as the load began; with it, none in a 5-minute soak. (Frozen objects are
    still freed by reference counting when they die; only a reference cycle among them stays.)"""
    gc.collect()
    gc.freeze()


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's teardown of torch and transformers, which took 3-10 s on
    a loaded 2-core machine after every drain had finished.  atexit handlers still run: there
    multiprocessing unlinks its semaphores and joins its queue threads, and logging flushes."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
