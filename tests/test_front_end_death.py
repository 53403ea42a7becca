"""A SIGKILLed front end leaves nothing behind: the engine sees it gone and exits, and with it the
forkserver and the resource tracker (each exits once no process holds its pipe, and the engine held
one of each). Before: the engine watched only its parent, the forkserver, so all three outlived the
front end (67 minutes in a soak) with the model in memory."""

from __future__ import annotations

import os
import signal
import time

import psutil

from bench.serve_process import serve


def test_the_engine_and_its_helpers_exit_when_the_front_end_is_killed(tmp_path) -> None:
    with serve([], tmp_path / "serve.log", ready_timeout=120) as srv:
        front = psutil.Process(srv.proc.pid)
        helpers = front.children(recursive=True)
        assert helpers  # the forkserver, the engine under it, the resource tracker
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            alive = [p for p in helpers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.2)
        for p in alive:  # do not leave them to the next test
            p.kill()
        assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
