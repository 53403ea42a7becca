"""The engine process: loads the model, then a scheduler thread owns it.

Started by the front end with the `spawn` start method.  The main thread only moves messages
from the input queue into an inbox (and watches for the parent's death); the scheduler thread
runs `schedule -> execute -> update` and puts outputs and statistics on the output queue.
SIGINT/SIGTERM are ignored here: the front end decides when to stop (drain first), and shuts
the engine down with a Shutdown message.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.speculative.config import SpecConfig
from engine.core.messages import AbortRequest, EngineDead, EngineInput, EngineReady, GenerateRequest, Shutdown, StatsUpdate

STATS_INTERVAL_S = 0.25  # while busy; an idle engine sends once, right after it goes idle


@dataclass(frozen=True)
class EngineArgs:
    model_dir: str
    engine_config: EngineConfig
    max_model_len: int
    max_running: int = 64
    prefill_token_budget: int = 1024
    spec: SpecConfig = SpecConfig(speculative="off")  # resolved: off, ngram, or draft with its directory


def max_model_len_of(model_dir: str | Path, requested: int | None) -> int:
    """The context length: --max-model-len if given, else the model's max_position_embeddings."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    native = int(cfg.get("max_position_embeddings") or 2048)
    return min(requested, native) if requested else native


def engine_main(args: EngineArgs, in_q: mp.Queue, out_q: mp.Queue) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore; an engine killed with -9 leaks it
    # (issue 14). The engine draws its progress bars from one process, so a thread lock does.
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    try:
        from engine.core.engine_core import CoreLimits, EngineCore
        from engine.worker.loader import load_model

        from engine.speculative.factory import make_speculation

        om = load_model(args.model_dir, args.engine_config)
        proposer, observers = make_speculation(args.spec, om)
        core = EngineCore.for_model(om, CoreLimits(args.max_running, args.prefill_token_budget, args.max_model_len), proposer, observers)
    except BaseException as e:  # noqa: BLE001 - report any load failure, then exit
        out_q.put(EngineDead(f"model load failed: {type(e).__name__}: {e}"))
        return
    inbox: queue.Queue[EngineInput] = queue.Queue()
    loop = threading.Thread(target=_scheduler_loop, args=(core, om.stats, inbox, out_q), name="scheduler", daemon=True)
    loop.start()
    out_q.put(EngineReady(args.model_dir, args.max_model_len, os.getpid()))
    parent = mp.parent_process()
    while loop.is_alive():
        try:
            msg = in_q.get(timeout=0.5)
        except queue.Empty:
            if parent is not None and not parent.is_alive():  # orphaned: nobody will read our output
                msg = Shutdown()
            else:
                continue
        inbox.put(msg)
        if isinstance(msg, Shutdown):
            break
    loop.join(timeout=10)
    om.close()
    # Skip interpreter teardown (issue 14): tearing down torch and the model's objects took
    # 5-15 s on a busy 2-core machine, which made every shutdown slow.
    _flush_and_exit(out_q, 0)


def _flush_and_exit(out_q: mp.Queue, code: int) -> None:
    """os._exit skips the queue's feeder thread: flush it first, or the last messages never arrive."""
    out_q.close()
    out_q.join_thread()
    os._exit(code)


def _scheduler_loop(core: Any, stats: Any, inbox: queue.Queue[EngineInput], out_q: mp.Queue) -> None:
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
                elif isinstance(msg, AbortRequest) and (o := core.abort(msg.request_id)) is not None:
                    out_q.put(o)
                dirty = True
            if core.has_work():
                for o in core.step():
                    out_q.put(o)
                dirty = True
            now = time.monotonic()
            idle = not core.has_work()
            if dirty and (idle or now - last_stats >= STATS_INTERVAL_S):
                out_q.put(StatsUpdate(len(core.scheduler.running), len(core.scheduler.waiting), stats.snapshot()))
                last_stats, dirty = now, False
    except BaseException as e:  # noqa: BLE001 - an engine bug must surface in the front end, not hang it
        out_q.put(EngineDead(f"engine loop failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        _flush_and_exit(out_q, 1)
