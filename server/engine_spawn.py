"""How engine processes start: forked from a forkserver that imported the engine once.

A fresh `spawn` process imports torch, transformers and the engine before it loads a byte of the
model: on the 2-core machine that was most of a restart after an engine SIGKILL (imports 4.9 s,
the embedded model's load 0.3 s, medians of `python -m bench restart-time`; 18.7 s of imports
once under a soak's load). The forkserver (multiprocessing's
`forkserver` start method) is one process, started with the first engine, that imports those
modules once (PRELOAD) and then forks each engine from itself: a restart pays for the fork and
the model load only. It holds no model, no thread and no CUDA context (importing torch creates
none), so a fork from it is as clean as a spawn; its memory is the imports', shared
copy-on-write with the engine it forked.

Signals: the first engine start (EngineClient._spawn) starts the forkserver while SIGINT and
SIGTERM are ignored, and ignored signals stay ignored across its exec and every fork: a SIGTERM
to the process group never reaches it or an engine; the front end decides (drain, Shutdown).
It exits when the front end does (multiprocessing closes its pipe).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext, SpawnContext

# What every engine imports before its model load (engine/launch.py's engine_main). "__main__":
# the front end's main script, which a child re-runs as __mp_main__ (`moe-offload serve`);
# cli.main: the same under `python -m cli` (named as a string: the server imports no cli module).
# A module that fails to import is skipped.
PRELOAD = (
    "__main__",
    "cli.main",
    "engine.launch",
    "engine.worker.loader",
    "engine.core.engine_core",
    "engine.speculative.factory",
)


def engine_context(preload: bool = True) -> ForkServerContext | SpawnContext:
    """The multiprocessing context engines start from: forkserver with PRELOAD where the platform
    has it (Linux, macOS), else spawn; spawn also with `preload=False` (--no-engine-preload)."""
    if not preload or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
