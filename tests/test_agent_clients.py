"""Real coding agents against `moe-offload serve` (issue 38): Claude Code (`claude -p`, the
Messages API) and Codex CLI (`codex exec`, the Responses API), the npm releases pinned in
tests/agent_clis.txt, installed from the npm registry into .cache/agent-clis on first use.

The model is the tiny random checkpoint with its context raised to 65,536 tokens (each
client's first prompt is about 20k tokens here).  A recording proxy between client and
server keeps every request: each must get 200, and what the clients send (a system-role
message, adaptive thinking, namespace and hosted tools, ...) is checked to still be there, so
a client release that changes it shows here.  Each client runs headless with a small output
limit (Claude Code: CLAUDE_CODE_MAX_OUTPUT_TOKENS; Codex sends none, so the server's
--default-max-tokens) and must finish its turn with no API error other than that limit.  The
server forces one tool call per conversation (--force-tool-call, arguments pinned to read a
file the test wrote): in the tool tests the client must run it and send the file's text back
in its next request; the plain turns leave that tool out of the client (so nothing is forced).

No network: the clients' update checks and telemetry are off, and any other connection goes
to a dead proxy (HTTPS_PROXY) while loopback is exempt (NO_PROXY)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_cli_install import BIN, install
from recording_proxy import Recording, recording_proxy
from server_fixtures import RunningServer, serve

pytestmark = pytest.mark.timeout(300)
MODEL, KEY = "tiny", "agent-key"
RUN_TIMEOUT_S = 200
CODEX_TOKENS = 48  # --default-max-tokens: Codex sets no output limit of its own
SHELL_ARGS = {"cmd": "cat hello.txt"}


def read_args(d: Path) -> dict[str, str]:
    return {"file_path": str(d / "hello.txt")}


def _installed() -> None:
    """The pinned CLIs, installed on first use (about 25 s; tests/agent_cli_install.py)."""
    problem = install()
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, str]:
    """The agents' working directory, with a file whose text only a tool run can know."""
    d = tmp_path_factory.mktemp("work")
    marker = f"MARKER-{uuid.uuid4().hex[:12]}"
    (d / "hello.txt").write_text(marker + "\n")
    return d, marker


@pytest.fixture(scope="module")
def srv(long_tiny_ckpt, workdir, tmp_path_factory) -> Iterator[RunningServer]:
    """The server, forcing one call of Read (Claude Code) or exec_command (Codex) per
    conversation, its arguments pinned to read hello.txt; the plain turns leave that tool out."""
    _installed()
    d, _ = workdir
    args = ["--model", str(long_tiny_ckpt), "--served-model-name", MODEL, "--api-key", KEY]
    # 4 sequences: the memory plan reserves KV for that many contexts.
    args += [
        "--max-running",
        "4",
        "--speculative",
        "off",
        "--default-max-tokens",
        str(CODEX_TOKENS),
    ]
    args += ["--force-tool-call", "Read=" + json.dumps(read_args(d))]
    args += ["--force-tool-call", "exec_command=" + json.dumps(SHELL_ARGS)]
    with serve(args, tmp_path_factory.mktemp("agents") / "server.log", ready_timeout=240) as s:
        yield s


def _env(home: Path) -> dict[str, str]:
    """A clean environment: nothing of the caller's credentials or settings, no network."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": "http://127.0.0.1:9",  # a dead port: any outside connection fails at once
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """Run a CLI to its end (its own process group, killed whole on timeout)."""
    p = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{cmd[0]} ran past {RUN_TIMEOUT_S} s:\n{out.decode(errors='replace')[-3000:]}")
    return p.returncode, out.decode(errors="replace")


def _json_lines(out: str) -> list[dict]:
    rows = []
    for line in out.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the CLIs also print plain warnings
    return rows


def _claude(
    rec: Recording, cwd: Path, max_tokens: int, home: Path, extra: list[str]
) -> tuple[int, list[dict]]:
    env = _env(home) | {
        "ANTHROPIC_BASE_URL": rec.url,
        "ANTHROPIC_API_KEY": KEY,
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # telemetry, error reports, updates
        "DISABLE_AUTOUPDATER": "1",
        **{
            f"ANTHROPIC_{k}": MODEL
            for k in (
                "MODEL",
                "SMALL_FAST_MODEL",
                "DEFAULT_HAIKU_MODEL",
                "DEFAULT_SONNET_MODEL",
                "DEFAULT_OPUS_MODEL",
            )
        },
    }
    cmd = [str(BIN / "claude"), "-p", "Say hello.", "--output-format", "stream-json", "--verbose"]
    rc, out = _run([*cmd, *extra], env, cwd)
    return rc, _json_lines(out)


def _codex(rec: Recording, cwd: Path, home: Path, tools: bool) -> tuple[int, list[dict], str]:
    codex_home = home / "codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "moe"\ncheck_for_update_on_startup = false\n'
        "[analytics]\nenabled = false\n"
        '[model_providers.moe]\nname = "moe-offload"\n'
        f'base_url = "{rec.url}/v1"\nwire_api = "responses"\nenv_key = "MOE_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n"
    )
    env = _env(home) | {"CODEX_HOME": str(codex_home), "MOE_KEY": KEY}
    cmd = [str(BIN / "codex"), "exec", "--json", "--skip-git-repo-check", "--ephemeral"]
    cmd += ["-C", str(cwd)]
    if tools:  # the forced call runs `cat hello.txt` in cwd; Codex's sandbox needs namespaces
        cmd.append("--dangerously-bypass-approvals-and-sandbox")
    else:  # no shell tool, so no forced call
        cmd += ["--disable", "shell_tool"]
    rc, out = _run([*cmd, "Say hello."], env, cwd)
    return rc, _json_lines(out), out


def _all_ok(rec: Recording, prefix: str, log: str) -> list:
    posts = rec.posts(prefix)
    assert posts, f"the client sent no {prefix} request"
    assert [e.status for e in rec.exchanges] == [200] * len(rec.exchanges), (
        [(e.path, e.status) for e in rec.exchanges],
        log[-2000:],
    )
    return posts


def _claude_checks(rec: Recording, rows: list[dict], rc: int, log: str) -> list:
    posts = _all_ok(rec, "/v1/messages", log)
    first = posts[0].body  # what Claude Code sends (DESIGN.md section 9), all accepted
    assert any(m["role"] == "system" for m in first["messages"]) and first["stream"] is True
    assert first["thinking"]["type"] in ("adaptive", "enabled") and len(first["tools"]) > 5
    result = rows[-1]
    assert result["type"] == "result", rows[-3:]
    # The turn ends; the one error allowed is the output limit the test set.
    assert rc == 0 or result.get("api_error") == "max_output_tokens", (rc, result)
    assert result.get("api_error_status") is None, result
    return posts


def test_claude_code_completes_a_turn(srv: RunningServer, workdir, tmp_path) -> None:
    with recording_proxy(srv.base_url) as rec:
        rc, rows = _claude(rec, workdir[0], 16, tmp_path / "home", ["--disallowedTools", "Read"])
    posts = _claude_checks(rec, rows, rc, srv.log())
    assert "Read" not in [t["name"] for t in posts[0].body["tools"]]  # so no call is forced
    blocks = [b for r in rows if r["type"] == "assistant" for b in r["message"]["content"]]
    assert all(b["type"] == "text" for b in blocks), rows  # may be empty: a sampled EOS
    assert not any(m["role"] == "tool" for p in posts for m in p.body["messages"])


def test_claude_code_runs_a_forced_tool_and_sends_the_result(srv, workdir, tmp_path) -> None:
    d, marker = workdir
    # Room for the pinned arguments (one token per byte with the tiny byte-level tokenizer).
    limit = len(json.dumps(read_args(d), separators=(",", ":")).encode()) + 8
    with recording_proxy(srv.base_url) as rec:
        rc, rows = _claude(rec, d, limit, tmp_path / "home", [])
    posts = _claude_checks(rec, rows, rc, srv.log())
    uses = [
        b
        for r in rows
        if r["type"] == "assistant"
        for b in r["message"]["content"]
        if b["type"] == "tool_use"
    ]
    assert [u["name"] for u in uses] == ["Read"], rows
    results = [
        b
        for p in posts
        for m in p.body["messages"]
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result" and b["tool_use_id"] == uses[0]["id"]
    ]
    assert results and marker in json.dumps(results[0]["content"]), [
        p.body["messages"][-1] for p in posts
    ]


def _codex_checks(rec: Recording, rows: list[dict], rc: int, out: str, log: str) -> list:
    posts = _all_ok(rec, "/v1/responses", log)
    first = posts[0].body  # what Codex sends (DESIGN.md section 9), all accepted
    kinds = {t["type"] for t in first["tools"]}
    assert {"function", "namespace"} <= kinds and first["stream"] is True, kinds
    assert rc == 0, out[-3000:]
    assert [r["type"] for r in rows if r["type"].startswith("turn.")] == [
        "turn.started",
        "turn.completed",
    ], out[-3000:]
    errors = [
        r for r in rows if r.get("type") == "error" or r.get("item", {}).get("type") == "error"
    ]
    # The one warning Codex prints about a model it has no metadata for is not an API error.
    assert all("Model metadata" in r["item"]["message"] for r in errors), errors
    return posts


def test_codex_completes_a_turn(srv: RunningServer, workdir, tmp_path) -> None:
    with recording_proxy(srv.base_url) as rec:
        rc, rows, out = _codex(rec, workdir[0], tmp_path / "home", tools=False)
    posts = _codex_checks(rec, rows, rc, out, srv.log())
    assert "exec_command" not in [t.get("name") for t in posts[0].body["tools"]]
    done = [r for r in rows if r["type"] == "turn.completed"][0]
    # Sampled (Codex sends no temperature): the random model may end early, never past the limit.
    assert done["usage"]["output_tokens"] <= CODEX_TOKENS, done


def test_codex_runs_a_forced_tool_and_sends_the_result(srv, workdir, tmp_path) -> None:
    d, marker = workdir
    with recording_proxy(srv.base_url) as rec:
        rc, rows, out = _codex(rec, d, tmp_path / "home", tools=True)
    posts = _codex_checks(rec, rows, rc, out, srv.log())
    ran = [r["item"] for r in rows if r.get("item", {}).get("type") == "command_execution"]
    assert ran and marker in ran[-1]["aggregated_output"], out[-3000:]
    outputs = [
        i
        for p in posts
        for i in p.body["input"]
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]
    assert outputs and marker in json.dumps(outputs[0]["output"]), [
        p.body["input"][-2:] for p in posts
    ]
