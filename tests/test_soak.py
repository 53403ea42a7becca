"""A two-minute soak (issue 53): the real server under every soak client at once (the SDKs,
Schemathesis, the real Claude Code and Codex CLIs), with engine SIGKILLs, expert read faults
(EIO, short reads, latency spikes), a shrunk memory cgroup and a full quant-cache disk while
they are busy, an idle check when the load stops and the SIGTERM drain at the end. No request
may be lost (each gets a whole answer or a clear error object in its API's shape), no 5xx may be
unexplained by the injected faults, and every client completes requests again after the faults."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import _parser, execute, passed
from bench.soak_idle import back_to_idle
from bench.soak_outcomes import Clock, Outcome, from_exception, settle
from bench.soak_summary import slope_per_minute

pytestmark = pytest.mark.timeout(420)

# The CI soak (issue 53: "a 2-minute soak runs in CI"): every client and every fault of the
# 30-minute run in docs/benchmarks/soak.md, packed into two minutes one after another: an engine
# SIGKILL at 15 s, the memory cgroup shrunk at 30 s, the quant cache's disk full at 48 s, expert
# read faults all along. Each death within a minute of the last lengthens the supervisor's
# restart backoff (1, 2, 4, 8, 16 s), so the faults are one each, the slowest to recover last,
# and none starts after 80 s: every client must finish requests again before the idle check
# and the SIGTERM drain.
CI_SOAK = [
    "--duration", "120", "--kill-every", "15", "--max-kills", "1",
    "--read-faults", "eio:period=4,short:period=3,delay:period=10:secs=2",
    "--memory-fault-every", "60", "--disk-full-every", "60", "--schemathesis", "--agent-clis",
]  # fmt: skip


def test_two_minute_soak_with_every_fault_and_client(tmp_path: Path) -> None:
    raw = execute(_parser().parse_args([*CI_SOAK, "--out", str(tmp_path), "--no-progress"]))
    s = raw["summary"]
    detail = {
        k: s[k]
        for k in ("outcomes", "lost_examples", "unexplained_examples", "restart_s", "faults")
    }
    assert s["lost"] == 0 and s["unexplained_5xx"] == 0, detail
    assert passed(raw) and s["exit_code"] == 0, detail
    # Each SIGKILL met requests in flight, and the engine served again after each.
    assert s["kills"] >= 1 and all(x is not None for x in s["restart_s"]), detail
    assert s["per_fault"].get("engine_sigkill", 0) >= 1, detail
    # Every kind of read fault fired; an EIO failed the requests that needed its expert with a
    # clear `expert_read_failed` error (counted as explained above), a short read or a spike none.
    injected = raw["read_faults"]["injected"]
    assert all(injected.get(k, 0) >= 1 for k in ("eio", "short", "delay")), injected
    assert s["per_fault"].get("expert_read_eio", 0) >= 1, detail
    # The OOM killer takes the engine, never the front end; a full disk fails engine starts
    # until it is freed; the server serves again after both.
    memory, disk = (
        next(f for f in raw["faults"] if f["kind"] == k) for k in ("memory_cgroup", "disk_full")
    )
    assert memory["detail"]["front_end_survived"], detail
    assert disk["detail"]["failed_starts"] >= 1, detail
    assert memory["serving_s"] is not None and disk["serving_s"] is not None, detail
    # Every client, the generated requests and the real agent CLIs included, completed requests
    # after the last fault; when the load stopped, KV blocks and the expert slots were back to idle.
    # The agent CLIs retry an outage on their own schedule (a Claude Code session begun at the memory fault
    # ran 73 s, through both faults, in one run; in others it was still backing off at the drain), so within
    # two minutes their recovery after the last fault is the CLIs' timing, not the server's: it is checked
    # by the 30-minute soak (docs/benchmarks/soak.md). Here every other client must have recovered.
    recovered = s["recovered_after_last_kill"]
    assert all(v for c, v in recovered.items() if c != "agent_cli"), recovered
    assert s["per_client"]["schemathesis"]["complete"] > 0, s["per_client"]
    assert s["per_client"]["agent_cli"]["complete"] > 0, s["per_client"]
    assert raw["idle"]["back"], raw["idle"]
    assert (tmp_path / "soak.json").is_file()


def test_outcomes_are_classified_by_their_error_object() -> None:
    clock = Clock()

    def settled(status: int | None, body: object) -> Outcome:
        return settle(Outcome("c", "k", 0.0), clock, status, body)

    restarted = settled(503, {"error": {"message": "m", "code": "engine_restarted"}})
    assert restarted.outcome == "fault" and not restarted.unexplained_5xx
    too_big = settled(
        413, {"type": "error", "error": {"type": "request_too_large", "message": "m"}}
    )
    assert too_big.outcome == "error" and too_big.code == "request_too_large"
    internal = settled(500, {"error": {"message": "m", "code": "internal_error"}})
    assert internal.outcome == "error" and internal.unexplained_5xx
    in_band = settled(None, {"message": "m", "code": "shutting_down"})
    assert in_band.outcome == "fault" and in_band.status == 200
    assert settled(502, "<html>bad gateway</html>").outcome == "lost"


def test_refused_only_counts_during_the_drain() -> None:
    clock = Clock()
    try:
        raise RuntimeError("Connection error.") from ConnectionRefusedError(111, "refused")
    except RuntimeError as e:
        err = e
    assert from_exception(Outcome("c", "k", 0.0), clock, err).outcome == "lost"
    clock.draining = True
    assert from_exception(Outcome("c", "k", 0.0), clock, err).outcome == "refused"
    closed = RuntimeError("Server disconnected without sending a response.")
    assert from_exception(Outcome("c", "k", 0.0), clock, closed).outcome == "refused"
    cut = RuntimeError("peer closed connection without sending complete message body")
    assert from_exception(Outcome("c", "k", 0.0), clock, cut).outcome == "lost"


def test_rss_slope_is_per_minute() -> None:
    ts = [float(t) for t in range(0, 600, 10)]
    assert abs(slope_per_minute(ts, [100 + t / 60 for t in ts]) - 1.0) < 1e-9  # type: ignore[operator]
    assert slope_per_minute([1.0, 2.0], [1.0, 2.0]) is None


def test_idle_check_compares_kv_in_use_and_the_split() -> None:
    before = {
        "kv_blocks": {"in_use": 0.0, "cached": 0.0},
        "memory_split": {"kv": 4.0, "experts": 12.0},
    }
    same = {
        "kv_blocks": {"in_use": 0.0, "cached": 96.0},
        "memory_split": {"kv": 4.0, "experts": 12.0},
    }
    assert back_to_idle(before, {"levels": same, "waited_s": 1.0, "idle": True})["back"]
    held = {**same, "kv_blocks": {"in_use": 3.0, "cached": 96.0}}  # a request's blocks not freed
    assert not back_to_idle(before, {"levels": held, "waited_s": 1.0, "idle": True})["back"]
    lent = {**same, "memory_split": {"kv": 8.0, "experts": 8.0}}  # slots still lent to the KV pool
    assert not back_to_idle(before, {"levels": lent, "waited_s": 1.0, "idle": True})["back"]
    assert not back_to_idle(before, {"levels": same, "waited_s": 150.0, "idle": False})["back"]
    assert not back_to_idle(None, {"levels": same, "waited_s": 1.0, "idle": True})["back"]
