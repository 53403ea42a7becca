"""The servers `python -m bench serve` can start itself: this engine (`python -m cli serve`, through
bench/serve_process.py) and llama-server on the same model's GGUF (bench/streams_vs_llama.py converts and
starts it). Each yields a bench.serve_client.Target with the pid of its process tree."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.serve_belady import BeladyProbe
from bench.serve_client import Target
from bench.serve_process import serve
from bench.streams_vs_llama import convert, llama_server


@contextmanager
def engine_target(
    model_dir: Path, engine_args: str, log: Path, route_log: Path | None = None
) -> Iterator[Target]:
    """This engine serving `model_dir` (plus `engine_args`, a shell-quoted string of serve flags);
    with `route_log`, it logs its experts' calls there and the target measures loads against
    Belady's MIN (bench/serve_belady.py)."""
    args = ["--model", str(model_dir), *shlex.split(engine_args)]
    if route_log is not None:
        args += ["--route-log", str(route_log)]
    with serve(args, log, ready_timeout=300) as srv:
        target = Target("engine", srv.base_url, pid=srv.proc.pid)
        if route_log is not None:
            target.loads = BeladyProbe(route_log, srv.base_url)
        yield target


def model_context(model_dir: Path) -> int:
    """The model's own context length (config.json's max_position_embeddings)."""
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


@contextmanager
def llama_target(
    exe: Path,
    model_dir: Path,
    gguf: Path | None,
    slots: int,
    threads: int,
    work: Path,
) -> Iterator[Target]:
    """llama-server with `slots` parallel slots of the model's whole context each, its prompt cache on
    and /metrics enabled, on `gguf` (default: `model_dir` converted to bf16 by llama.cpp's converter,
    which lives in the source tree the binary was built in: EXE/../../..)."""
    if gguf is None:
        src = exe.resolve().parents[2]
        gguf = convert(src, model_dir, work / f"{model_dir.name}-bf16.gguf")
    log = work / f"llama-server-np{slots}.log"
    with llama_server(exe, gguf, slots, model_context(model_dir), threads, log, ("--metrics",)) as (
        url,
        pid,
    ):
        yield Target(f"llama-server -np {slots}", url, pid=pid, extra_body={"cache_prompt": True})
