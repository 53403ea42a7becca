"""The engine process's scheduler loop reports why it died before exiting."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from engine.core.engine_process import _scheduler_loop
from engine.core.messages import EngineDead, GenerateRequest
from engine.worker.sampling import SamplingParams


class _BrokenCore:
    """Has work, then fails inside step(), as an engine bug would."""

    scheduler = None

    def has_work(self) -> bool:
        return True

    def add(self, req: GenerateRequest) -> None:
        pass

    def step(self) -> list:
        raise ZeroDivisionError("injected engine bug")


class _Stats:
    def snapshot(self) -> dict:
        return {}


def _child(out_q: mp.Queue) -> None:
    inbox: queue.Queue = queue.Queue()
    inbox.put(GenerateRequest("r", [1, 2], SamplingParams()))
    _scheduler_loop(_BrokenCore(), _Stats(), inbox, out_q)  # ends the process with os._exit(1)


@pytest.mark.timeout(60)
def test_crash_reason_reaches_the_parent_before_exit() -> None:
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    p = ctx.Process(target=_child, args=(out_q,))
    p.start()
    msg = out_q.get(timeout=40)  # without the flush, os._exit drops it and this times out
    p.join(10)
    # One line for the front end (its type and an error id); the traceback went to the log.
    assert (
        isinstance(msg, EngineDead)
        and "ZeroDivisionError" in msg.error
        and "error id err-" in msg.error
    )
    assert "Traceback" not in msg.error and "injected engine bug" not in msg.error
    assert p.exitcode == 1
