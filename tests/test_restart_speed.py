"""Issue 53's restart and /health items: engines fork from a forkserver that imported the engine once,
an engine that served a while restarts without backoff, and the front end's startup objects are
out of the garbage collector's reach (a full collection walked them all, blocking /health)."""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace
from typing import Any

import pytest

from server.engine_client import BACKOFF_S, STABLE_S, EngineClient, EngineState
from server.engine_spawn import PRELOAD, engine_context
from server.launch import freeze_startup_objects
from server.metrics import ServerMetrics


class _Loop:
    def call_later(self, delay: float, fn: Any) -> None:
        self.delay = delay


def test_engines_start_from_a_preloaded_forkserver_unless_told_not_to() -> None:
    ctx = engine_context(preload=True)
    assert ctx.get_start_method() == "forkserver"
    assert {"engine.worker.loader", "engine.launch"} <= set(PRELOAD)
    assert engine_context(preload=False).get_start_method() == "spawn"


def test_every_preloaded_module_exists() -> None:
    """The forkserver skips a module that fails to import: a renamed one (server.cli became
    cli.main) would silently stop being preloaded."""
    import importlib.util

    for name in PRELOAD:
        if name != "__main__":
            assert importlib.util.find_spec(name) is not None, name


@pytest.mark.parametrize(("served_s", "delay"), [(STABLE_S + 5, 0.0), (5.0, BACKOFF_S[0])])
def test_an_engine_that_served_a_while_restarts_at_once(served_s: float, delay: float) -> None:
    client = EngineClient(None, ServerMetrics(), max_restarts=3)  # type: ignore[arg-type]
    client._loop = loop = _Loop()  # type: ignore[assignment]
    client._engine = SimpleNamespace(release=lambda: None)  # type: ignore[assignment]
    client.state, client.engine_pid = EngineState.READY, 1234
    client._ready_at = time.monotonic() - served_s
    client._on_death("engine process exited (code -9)")
    assert client.state is EngineState.RESTARTING and loop.delay == delay


def test_the_backoff_counts_deaths_since_the_last_engine_that_served_a_while() -> None:
    """A crash loop backs off 1, 2, 4 s; an engine that served a minute resets it, so a quick
    death after good service waits 1 s, however many restarts the window holds."""
    client = EngineClient(None, ServerMetrics(), max_restarts=10)  # type: ignore[arg-type]
    client._loop = loop = _Loop()  # type: ignore[assignment]
    delays = []
    for served_s in (5.0, 5.0, 5.0, STABLE_S + 5, 5.0):
        client._engine = SimpleNamespace(release=lambda: None)  # type: ignore[assignment]
        client.state, client.engine_pid = EngineState.READY, 1234
        client._ready_at = time.monotonic() - served_s
        client._on_death("engine process exited (code -9)")
        delays.append(loop.delay)
    assert delays == [BACKOFF_S[0], BACKOFF_S[1], BACKOFF_S[2], 0.0, BACKOFF_S[0]]
    assert len(client._restarts) == 5  # the restart budget still counts every one


def test_startup_objects_are_frozen_out_of_the_collector() -> None:
    import server.app  # noqa: F401  (the front end's imports: torch, transformers, fastapi)

    # Count after a collection: earlier tests in this worker may leave cyclic garbage, which the
    # freeze's own collection frees (it once made the frozen count 89 % of a count taken before).
    gc.collect()
    tracked = len(gc.get_objects())  # what a full collection walks
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0.9 * tracked
        assert len(gc.get_objects()) < 0.1 * tracked  # a collection now walks only newer objects
    finally:
        gc.unfreeze()
