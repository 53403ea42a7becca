"""A short soak (issue 53): the real server under every soak client at once, an engine SIGKILL
and expert read faults (EIO, short reads, latency spikes) while they are busy, and the SIGTERM
drain at the end.  No request may be lost (each gets a
whole answer or a clear error object in its API's shape), no 5xx may be unexplained by the
injected faults, and every client completes requests again after the engine came back."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import _parser, execute, passed
from bench.soak_outcomes import Clock, Outcome, from_exception, settle
from bench.soak_summary import slope_per_minute

pytestmark = pytest.mark.timeout(240)


def test_short_soak_with_an_engine_sigkill_and_read_faults(tmp_path: Path) -> None:
    faults = "eio:period=4,short:period=3,delay:period=10:secs=2"
    args = _parser().parse_args(
        ["--duration", "35", "--kill-every", "10", "--out", str(tmp_path), "--no-progress"]
        + ["--read-faults", faults]
    )
    raw = execute(args)
    s = raw["summary"]
    detail = {k: s[k] for k in ("outcomes", "lost_examples", "unexplained_examples", "restart_s")}
    assert s["kills"] >= 1 and all(x is not None for x in s["restart_s"]), detail
    assert s["lost"] == 0 and s["unexplained_5xx"] == 0, detail
    assert passed(raw) and s["exit_code"] == 0, detail
    assert s["per_fault"].get("engine_sigkill", 0) >= 1, detail  # the kill met requests in flight
    # Every kind of read fault fired; an EIO failed the requests that needed its expert with a
    # clear `expert_read_failed` error (counted as explained above), a short read or a spike none.
    injected = raw["read_faults"]["injected"]
    assert all(injected.get(k, 0) >= 1 for k in ("eio", "short", "delay")), injected
    assert s["per_fault"].get("expert_read_eio", 0) >= 1, detail
    assert all(s["recovered_after_last_kill"].values()), s["recovered_after_last_kill"]
    sdk = ("openai_chat", "openai_completions", "anthropic", "responses")
    assert all(s["per_client"][c]["complete"] > 0 for c in sdk), s["per_client"]
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_soak_with_memory_and_disk_faults_schemathesis_and_agent_clis(
    tmp_path: Path,
) -> None:
    """The resource faults and the generated and agent-CLI clients together (2 minutes, so slow):
    the OOM killer takes the engine, never the front end; a full disk fails engine starts until
    it is freed; nothing is lost and every client finishes requests after the last fault."""
    args = _parser().parse_args(
        ["--duration", "100", "--kill-every", "0", "--memory-fault-every", "60"]
        + ["--disk-full-every", "60", "--schemathesis", "--agent-clis"]
        + ["--out", str(tmp_path), "--no-progress"]
    )
    raw = execute(args)
    s = raw["summary"]
    detail = {k: s[k] for k in ("outcomes", "lost_examples", "unexplained_examples", "faults")}
    assert passed(raw) and s["exit_code"] == 0, detail
    memory, disk = raw["faults"]
    assert memory["kind"] == "memory_cgroup" and memory["detail"]["front_end_survived"], detail
    assert disk["kind"] == "disk_full" and disk["detail"]["failed_starts"] >= 1, detail
    assert memory["serving_s"] is not None and disk["serving_s"] is not None, detail
    assert s["per_fault"].get("disk_full", 0) >= 1, detail
    assert s["per_client"]["schemathesis"]["complete"] > 0, s["per_client"]
    assert s["per_client"]["agent_cli"]["complete"] > 0, s["per_client"]
