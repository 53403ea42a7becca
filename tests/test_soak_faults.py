"""The soak's resource faults and its generated and agent-CLI clients (issue 53), in pieces:
the memory cgroup shrunk and the quant cache's disk filled (bench/soak_faults.py; root, as CI
and this machine run), how a Schemathesis exchange and an agent-CLI session become outcomes, and
how the summary lays each cut request at the door of the fault that cut it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.cgroup import MemoryCgroup
from bench.soak_agents import verdict
from bench.soak_clients import Ctx
from bench.soak_faults import UNLIMITED, DiskFault
from bench.soak_generated import outcome_of
from bench.soak_outcomes import CLI_FAULT, Clock, Outcome
from bench.soak_summary import summarize

# Holds 32 MiB, says so, and waits (-S: no site imports, so it starts fast under a tight limit).
HOG = "import sys, time\nb = bytearray(32 << 20)\nsys.stdout.write('ok\\n'); sys.stdout.flush()\ntime.sleep(60)"


def test_a_shrunk_memory_cgroup_charges_and_kills_inside_it() -> None:
    why = MemoryCgroup.unavailable()
    if why is not None:
        pytest.skip(why)
    cg = MemoryCgroup(UNLIMITED, name=f"moe-offload-test-{os.getpid()}")
    procs = str(cg.path / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as fh:
            fh.write("0")  # 0: the writing process itself

    hog = subprocess.Popen(
        [sys.executable, "-S", "-c", HOG], stdout=subprocess.PIPE, text=True, preexec_fn=enter
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline() == "ok\n"
        assert cg.anon() >= 32 << 20 and cg.usage() >= cg.anon()
        kills = cg.oom_kills()
        try:  # below what it holds: v1 refuses (EBUSY), v2 kills at once
            cg.set_limit(16 << 20)
        except OSError:
            assert cg.version == 1
            # The tightest limit it takes, then a second process that needs 32 MiB more: the
            # OOM killer acts inside the group, on its largest process.
            cg.set_limit(cg.anon() + (4 << 20))
            child = subprocess.Popen([sys.executable, "-S", "-c", HOG], preexec_fn=enter)
            deadline = time.monotonic() + 30
            while hog.poll() is None and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert -signal.SIGKILL in (hog.poll(), child.poll())
            child.kill()
            child.wait()
        else:
            assert hog.wait(30) == -signal.SIGKILL
        assert cg.oom_kills() == kills + 1
    finally:
        hog.kill()
        hog.wait()
        time.sleep(0.1)
        cg.close()
    assert not cg.path.exists()


def test_the_disk_fault_fills_its_tmpfs_and_frees_it() -> None:
    disk = DiskFault()
    try:
        assert disk.server_args()[:2] == ["--expert-quant", "int8"]
        disk._fill()
        with pytest.raises(OSError), open(disk.dir / "more", "wb") as f:
            f.write(b"x" * 65536)
        (disk.dir / "filler").unlink()
        (disk.dir / "more").write_bytes(b"x" * 65536)  # room again
    finally:
        disk.close()
    assert not disk.dir.exists()


def _entry(method: str, path: str, status: int, body: str, ctype: str = "application/json"):
    return {
        "request": {"method": method, "url": "http://127.0.0.1:1" + path},
        "response": {"status": status, "content": {"text": body, "mimeType": ctype}},
    }


@pytest.mark.parametrize(
    ("entry", "outcome", "code"),
    [
        (_entry("POST", "/v1/completions", 200, '{"choices": []}'), "complete", None),
        (
            _entry("POST", "/v1/chat/completions", 400, '{"error": {"message": "m", "code": "invalid_value"}}'),
            "error",
            "invalid_value",
        ),
        (
            _entry("POST", "/v1/messages", 503, '{"type": "error", "error": {"type": "engine_restarting", "message": "m"}}'),
            "fault",
            "engine_restarting",
        ),
        (_entry("GET", "/health", 503, '{"status": "restarting", "error": "e"}'), "fault", "engine_restarting"),
        (_entry("GET", "/health", 503, '{"status": "dead"}'), "error", "dead"),
        (_entry("POST", "/health", 405, '{"error": {"message": "Method Not Allowed", "type": "t"}}'), "error", "t"),
        (_entry("GET", "/metrics", 200, 'x{finish_reason="error"} 1', "text/plain"), "complete", None),
        (
            _entry("POST", "/v1/completions", 200, 'data: {"error": {"message": "m", "code": "expert_read_failed"}}\n\ndata: [DONE]', "text/event-stream"),
            "fault",
            "expert_read_failed",
        ),
        (
            _entry("POST", "/v1/completions", 500, '{"error": {"message": "Traceback (most recent call last): File \\"/srv/x.py\\""}}'),
            "lost",
            None,
        ),
        (_entry("POST", "/v1/completions", 0, ""), "lost", None),
    ],
)  # fmt: skip
def test_a_schemathesis_exchange_becomes_an_outcome(entry, outcome: str, code: str | None) -> None:
    ctx = Ctx("http://127.0.0.1:1", "soak", Clock(), 1024)
    o = outcome_of(Outcome("schemathesis", "k", 0.0), ctx, entry)
    assert (o.outcome, o.code) == (outcome, code), o


def test_no_schemathesis_answer_is_refused_only_in_the_drain() -> None:
    ctx = Ctx("http://127.0.0.1:1", "soak", Clock(draining=True), 1024)
    o = outcome_of(Outcome("schemathesis", "k", 0.0), ctx, _entry("GET", "/v1/models", 0, ""))
    assert o.outcome == "refused"


def test_an_agent_cli_session_becomes_an_outcome() -> None:
    ok = '{"type": "result", "api_error": "max_output_tokens", "api_error_status": null}'
    assert verdict("claude_code", [ok, "rc=1"])[0] == "complete"
    busy = '{"type": "result", "api_error_status": 529, "result": "overloaded"}'
    assert verdict("claude_code", [busy, "rc=1"])[:2] == ("fault", 529)
    bad = '{"type": "result", "api_error_status": 400, "result": "Prompt is too long"}'
    assert verdict("claude_code", [bad, "rc=1"])[:2] == ("error", 400)
    assert verdict("claude_code", ["warning", "rc=1"])[0] == "lost"  # no result row
    turn = ['{"type": "turn.started"}', '{"type": "turn.completed"}']
    assert verdict("codex", [*turn, "rc=0"])[0] == "complete"
    failed = (
        '{"type": "turn.failed", "error": {"message": "unexpected status 503 Service Unavailable"}}'
    )
    assert verdict("codex", ['{"type": "turn.started"}', failed, "rc=1"])[:2] == ("fault", 503)
    cut = '{"type": "turn.failed", "error": {"message": "stream disconnected before completion: The engine failed: engine process exited (code -9)"}}'
    assert verdict("codex", [cut, "rc=1"])[:2] == ("fault", None)
    assert verdict("codex", ["rc=timeout"])[0] == "lost"
    assert verdict("codex", ["rc=stopped"])[0] == "refused"


def _req(client: str, t1: float, status: int, code: str, outcome: str = "fault") -> dict:
    return {"client": client, "kind": "k", "t0": t1 - 1, "t1": t1, "outcome": outcome, "status": status, "code": code, "detail": ""}  # fmt: skip


def test_each_cut_request_is_laid_to_the_fault_that_cut_it() -> None:
    raw = {
        "kills": [{"t": 10.0, "pid": 1, "restart_s": 2.0}],
        "faults": [
            {"kind": "memory_cgroup", "t": 30.0, "lifted": 40.0, "serving_s": 15.0, "detail": {}},
            {"kind": "disk_full", "t": 60.0, "lifted": 70.0, "serving_s": 18.0, "detail": {}},
        ],
        "drain": {"t": 100.0, "seconds": 1.0, "exit_code": 0},
        "samples": [],
        "requests": [
            _req("openai_chat", 11.0, 503, "engine_restarting"),
            _req("openai_chat", 41.0, 503, "engine_restarted"),
            _req("anthropic", 75.0, 529, "engine_restarting"),
            _req("agent_cli", 62.0, 503, CLI_FAULT),
            _req("agent_cli", 101.0, 503, CLI_FAULT),
            _req("agent_cli", 90.0, 500, CLI_FAULT),  # in no window: not explained
            _req("openai_chat", 95.0, 200, "", "complete"),
            # an agent session begun while the engine restarted, ended served after: recovered
            {**_req("responses", 96.0, 200, "", "complete"), "t0": 70.0},
            _req("slow_reader", 77.0, 200, "", "complete"),  # ended before the restart was done
        ],
    }
    s = summarize(raw)
    assert s["per_fault"] == {
        "engine_sigkill": 1,
        "memory_cgroup": 1,
        "disk_full": 2,
        "sigterm_drain": 1,
    }
    assert s["per_client_fault"]["agent_cli"] == {"disk_full": 1, "sigterm_drain": 1}
    assert s["unexplained_5xx"] == 1 and s["unexplained_examples"][0]["client"] == "agent_cli"
    # Recovered: a completed request after the last fault's restart (60 + 18 s).
    assert s["recovered_after_last_kill"]["openai_chat"] is True
    assert s["recovered_after_last_kill"]["anthropic"] is False
    assert s["recovered_after_last_kill"]["responses"] is True
    assert s["recovered_after_last_kill"]["slow_reader"] is False
