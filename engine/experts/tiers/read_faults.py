"""Injected faults of the slow tier's expert reads: the hook a soak or a test uses to meet I/O errors.

`EngineConfig.expert_read_faults` (flag --expert-read-faults) names them; nothing else turns them on.
The spec is a comma-separated list of faults, each `KIND[:KEY=VALUE]...`:

- `eio`: the read fails with EIO (OSError errno 5), as a failing disk's would. The requests that
  needed the expert end with a `expert_read_failed` error; the others go on (engine/worker/runner.py).
- `short`: the read's first pread returns only part of the bytes asked (aligned for O_DIRECT), as
  a signal or a network filesystem may cause; the reader reads the rest (engine/experts/tiers/uncached_io.py),
  so the request completes. Only the disk tier makes reads; on the RAM tier a `short` fault is a no-op.
- `delay`: the read waits `secs` seconds first (a latency spike): the request only slows.

When each fault fires (per expert fetch, counted from the end of the model's load, so a warm-up
never meets one): `p=F` with probability F per fetch (seeded by `seed=N`, default 0), `every=N`
on every Nth fetch, `period=S` on the first fetch once S seconds have passed since its last
firing (a schedule in time, for a soak), `after=N` not before the Nth fetch. `secs=S` is the
delay (default 2). Examples: `eio:every=50`, `short:p=0.2,delay:period=30:secs=3`.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time

from engine.read_fault_spec import KINDS, FaultRule

# Named as before the move into tiers/ (issue 52): the engine's log lines print the logger's name.
log = logging.getLogger("engine.experts.read_faults")


class ReadFaults:
    """The hook itself: the slow tier asks it before each fetch (`before_fetch`), the disk reader
    before each pread (`cut`). Thread-safe: the transfer threads fetch at once. Disarmed until
    `arm()` (the loader's last step), and every fault fired is counted in `counts` and logged."""

    def __init__(self, rules: tuple[FaultRule, ...]) -> None:
        self.rules = rules
        self.counts = {kind: 0 for kind in KINDS}
        self.armed = False
        self._lock = threading.Lock()
        self._fetches = 0
        self._rngs = [random.Random(r.seed) for r in rules]
        self._last = [0.0 for _ in rules]
        self._pending_cut = (
            threading.local()
        )  # a `short` fault waiting for this thread's next pread

    def arm(self) -> None:
        with self._lock:
            self.armed, self._fetches = True, 0
            self._last = [time.monotonic() for _ in self.rules]

    def _fired(self) -> list[FaultRule]:
        """The rules that fire on this fetch (at most one of each)."""
        with self._lock:
            if not self.armed:
                return []
            self._fetches += 1
            n, now, fired = self._fetches, time.monotonic(), []
            for i, r in enumerate(self.rules):
                if n <= r.after:
                    continue
                if r.p:
                    hit = self._rngs[i].random() < r.p
                elif r.every:
                    hit = (n - r.after) % r.every == 0
                else:
                    hit = now - self._last[i] >= r.period
                if hit:
                    self._last[i] = now
                    self.counts[r.kind] += 1
                    fired.append(r)
            return fired

    def before_fetch(self, layer: int, expert: int) -> None:
        """Apply the faults that fire on this fetch: wait out a delay, arm a short read for this
        thread's next pread, raise EIO (last, so a delay and an error can come together)."""
        fired = self._fired()
        self._pending_cut.on = any(r.kind == "short" for r in fired)
        for r in fired:
            log.warning(
                "injected expert read fault: %s on expert %d of layer %d", r.kind, expert, layer
            )
            if r.kind == "delay":
                time.sleep(r.secs)
        if any(r.kind == "eio" for r in fired):
            raise OSError(errno.EIO, "Input/output error (injected)")

    def after_fetch(self) -> None:
        """Drop a short read no pread took (the RAM tier makes none)."""
        self._pending_cut.on = False

    def cut(self, want: int, align: int) -> int:
        """How many of `want` bytes this pread asks for: about half when a short fault is armed on
        this thread (a multiple of `align`, at least one `align`), else all of them."""
        if not getattr(self._pending_cut, "on", False) or want <= align:
            return want
        self._pending_cut.on = False
        return max(align, (want // 2) // align * align)
