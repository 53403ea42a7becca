"""The engine process's entry point: the one place that assembles a loaded model, its speculation
and an EngineCore (the composition root, above every other engine package), then hands the core to
its loop (engine/core/engine_process.py).

Started by the front end with the `spawn` start method. SIGINT/SIGTERM are ignored here: the front
end decides when to stop (drain first), and shuts the engine down with a Shutdown message.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.core.engine_process import run_engine
from engine.core.faults import describe, log, new_error_id
from engine.core.limits import CoreLimits
from engine.core.messages import EngineDead, EngineReady
from engine.memory.planner import KvRequest
from engine.speculative.config import SpecConfig
from engine.weights.model_config import read_config


@dataclass(frozen=True)
class EngineArgs:
    model_dir: str
    engine_config: EngineConfig
    # max_running, prefill_token_budget and the resolved max_model_len (defaults: engine/core/limits.py).
    limits: CoreLimits
    # Resolved: off, ngram, or draft with its directory.
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(speculative="off"))
    spec_why: str = ""  # why that mode (SpecConfig.choose), for the plan's log line
    # --max-model-len / --max-running as given (None where open): what the KV reservation covers.
    kv_request: KvRequest = field(default_factory=KvRequest)


def max_model_len_of(model_dir: str | Path, requested: int | None) -> int:
    """The context length: --max-model-len if given, else the model's max_position_embeddings. A missing
    or unreadable config.json fails in one line (read_config's), before anything else reads it."""
    read_config(Path(model_dir))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    native = int(cfg.get("max_position_embeddings") or 2048)
    return min(requested, native) if requested else native


# The engine's /proc/self/oom_score_adj (-1000..1000; 0 is the default every process inherits).
# When a memory limit is hit (a cgroup shrunk under load: `python -m bench soak
# --memory-fault-every`), the kernel's OOM killer picks the process with the highest score, about
# its share of memory plus this value in thousandths of the limit. Without it the front end,
# usually the larger process, was killed: every client connection gone and the server exited
# (-9). With it the engine goes first, and the front end's supervisor restarts it.
ENGINE_OOM_SCORE_ADJ = 500


def prefer_as_oom_victim() -> None:
    """Make this process the OOM killer's choice before a process at the default score (raising
    one's own score needs no privilege); where /proc is not Linux's, nothing happens."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(ENGINE_OOM_SCORE_ADJ))
    except OSError:
        pass


def engine_main(args: EngineArgs, in_q: mp.Queue, out_q: mp.Queue) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prefer_as_oom_victim()
    # The child's log (tracebacks under error ids) goes to the stderr it shares with the server.
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # tqdm's default lock is a multiprocessing semaphore; an engine killed with -9 leaks it
    # (issue 14). The engine draws its progress bars from one process, so a thread lock does.
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    try:
        from engine.core.engine_core import EngineCore
        from engine.speculative.factory import make_speculation
        from engine.worker.loader import load_model

        om = load_model(args.model_dir, args.engine_config, args.kv_request)
        proposer, observers = make_speculation(args.spec, om)
        core = EngineCore.for_model(
            om,
            args.limits,
            proposer,
            observers,
        )
    except BaseException as e:  # noqa: BLE001 - report any load failure, then exit
        eid = new_error_id()
        log.error("model load failed [error id %s]", eid, exc_info=e)
        out_q.put(EngineDead(f"model load failed: {describe(e)} (error id {eid})"))
        return
    # What the load made (the model, the imports' objects) lives as long as the process: out of
    # the garbage collector's reach, so a full collection never walks it between two steps (as
    # server/launch.py does for the front end, whose imports alone took 235 ms to walk).
    # No gc.collect() first: it took 256-300 ms of each restart, for the 19 objects of cyclic
    # garbage the imports leave.
    gc.freeze()
    # The start-up line: the load plan, with the speculation the front end resolved.
    plan = om.load_plan.with_speculation(
        args.spec.speculative,
        args.spec_why or f"--speculative {args.spec.speculative}",
    )
    ready = EngineReady(args.model_dir, args.limits.max_model_len, os.getpid(), tuple(plan.lines()))
    run_engine(core, om.stats, om.close, ready, in_q, out_q)
