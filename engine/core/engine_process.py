"""The engine process's loop, once its core is built (engine/launch.py loads the model and builds it).

The main thread only moves messages from the input queue into an inbox (and watches for the
parent's death); the scheduler thread runs `schedule -> execute -> update` and puts outputs and
statistics on the output queue.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.core.faults import describe, log, new_error_id
from engine.core.messages import (
    AbortRequest,
    EngineDead,
    EngineInput,
    EngineReady,
    GenerateRequest,
    Shutdown,
    StatsUpdate,
)

STATS_INTERVAL_S = 0.25  # while busy; an idle engine sends once, right after it goes idle


def run_engine(
    core: Any,
    stats: Any,
    close: Callable[[], None],
    ready: EngineReady,
    in_q: mp.Queue,
    out_q: mp.Queue,
) -> None:
    """The engine process's life once `core` is built (engine/launch.py builds it): a scheduler thread
    owns the core; this thread moves messages from the input queue into its inbox and watches for
    the parent's death. Ends the process."""
    inbox: queue.Queue[EngineInput] = queue.Queue()
    loop = threading.Thread(
        target=_scheduler_loop, args=(core, stats, inbox, out_q), name="scheduler", daemon=True
    )
    loop.start()
    out_q.put(ready)
    # Orphaned when the front end is gone. Under the forkserver our parent is the forkserver, which
    # outlives a SIGKILLed front end: it exits only when every holder of its "alive" pipe has, and we
    # hold one (as we hold the resource tracker's). So the front end itself is watched, by pid
    # (mp.parent_process(): the process that asked for us; not its sentinel, the pipe our start data
    # came through, closed as soon as it was read); and a changed parent pid (a plain fork's orphan).
    parent = os.getppid()
    front = mp.parent_process()
    front_pid = front.pid if front is not None else None
    while loop.is_alive():
        try:
            msg = in_q.get(timeout=0.5)
        except queue.Empty:
            if os.getppid() != parent or (front_pid is not None and not _running(front_pid)):
                msg = Shutdown()  # orphaned: nobody will read our output
            else:
                continue
        inbox.put(msg)
        if isinstance(msg, Shutdown):
            break
    loop.join(timeout=10)
    close()
    # Skip interpreter teardown (issue 14): tearing down torch and the model's objects took
    # 5-15 s on a busy 2-core machine, which made every shutdown slow.
    _flush_and_exit(out_q, 0)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie waiting for its parent has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc: it exists if it can be signalled
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def _flush_and_exit(out_q: mp.Queue, code: int) -> None:
    """os._exit skips the queue's feeder thread: flush it first, or the last messages never arrive."""
    out_q.close()
    out_q.join_thread()
    os._exit(code)


def _scheduler_loop(
    core: Any, stats: Any, inbox: queue.Queue[EngineInput], out_q: mp.Queue
) -> None:
    """Owns the engine core: moves messages in, steps, sends outputs and statistics out."""
    last_stats = 0.0
    dirty = True
    try:
        while True:
            # Block only when idle, so running requests keep decoding while messages arrive.
            msgs: list[EngineInput] = []
            if not core.has_work() and not dirty:
                msgs.append(inbox.get())
            while True:
                try:
                    msgs.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in msgs:
                if isinstance(msg, Shutdown):
                    for o in core.abort_all():
                        out_q.put(o)
                    return
                if isinstance(msg, GenerateRequest):
                    core.add(msg)
                elif (
                    isinstance(msg, AbortRequest) and (o := core.abort(msg.request_id)) is not None
                ):
                    out_q.put(o)
                dirty = True
            if core.has_work():
                for o in core.step():
                    out_q.put(o)
                dirty = True
            now = time.monotonic()
            idle = not core.has_work()
            if dirty and (idle or now - last_stats >= STATS_INTERVAL_S):
                out_q.put(
                    StatsUpdate(
                        len(core.scheduler.running), len(core.scheduler.waiting), stats.snapshot()
                    )
                )
                last_stats, dirty = now, False
    except BaseException as e:  # noqa: BLE001 - an engine bug must surface in the front end, not hang it
        # The traceback stays in the log; the front end (and so /health and error bodies) gets one line.
        eid = new_error_id()
        log.error("engine loop failed [error id %s]", eid, exc_info=e)
        out_q.put(EngineDead(f"engine loop failed: {describe(e)} (error id {eid})"))
        _flush_and_exit(out_q, 1)
