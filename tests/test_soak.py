"""A short soak (issue 53): the real server under every soak client at once, an engine SIGKILL
while they are busy, and the SIGTERM drain at the end.  No request may be lost (each gets a
whole answer or a clear error object in its API's shape), no 5xx may be unexplained by the
injected faults, and every client completes requests again after the engine came back."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import _parser, execute, passed

pytestmark = pytest.mark.timeout(240)


def test_short_soak_with_an_engine_sigkill(tmp_path: Path) -> None:
    args = _parser().parse_args(
        ["--duration", "40", "--kill-every", "10", "--out", str(tmp_path), "--no-progress"]
    )
    raw = execute(args)
    s = raw["summary"]
    detail = {k: s[k] for k in ("outcomes", "lost_examples", "unexplained_examples", "restart_s")}
    assert s["kills"] >= 1 and all(x is not None for x in s["restart_s"]), detail
    assert s["lost"] == 0 and s["unexplained_5xx"] == 0, detail
    assert passed(raw) and s["exit_code"] == 0, detail
    assert s["per_fault"].get("engine_sigkill", 0) >= 1, detail  # the kill met requests in flight
    assert all(s["recovered_after_last_kill"].values()), s["recovered_after_last_kill"]
    sdk = ("openai_chat", "openai_completions", "anthropic", "responses")
    assert all(s["per_client"][c]["complete"] > 0 for c in sdk), s["per_client"]
    assert (tmp_path / "soak.json").is_file()
