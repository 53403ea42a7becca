"""The soak's agent-CLI client (`--agent-clis`): real Claude Code and Codex CLI sessions.

The releases pinned in tests/agent_clis.txt (installed from npm into .cache/agent-clis by
tests/agent_cli_install.py on first use). Each step is one headless session, `claude -p` (the
Messages API) or `codex exec` (the Responses API), one turn with a small output limit, in a clean
environment with no network but loopback (as tests/test_agent_clients.py runs them). Each
session is one Outcome (kind `session`), though it sends several HTTP requests:

- `complete`: the turn ended (exit 0, or Claude Code's output-token limit that the soak sets);
- `fault`: the CLI gave up on an API error with a 5xx, 429 or 529 status (after its own
  retries); the CLI shows the status, not the fault class, so bench/soak_summary.py counts such a
  5xx as explained only when the session ended while a fault was injected or in the drain;
  `error`: a 4xx it reported;
- `refused`: the soak stopped while the session ran, after the server drained and exited;
- `lost`: anything else (no final result, a session past SESSION_TIMEOUT_S).

Their first prompt is about 5,200 tokens with the embedded model's tokenizer, above its 1,024
native context: the soak then serves a copy of the model whose config allows AGENT_CONTEXT
(RoPE positions: any length runs; the weights are the same files, linked).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.serve_process import REPO
from bench.soak_clients import Ctx, backoff
from bench.soak_outcomes import CLI_FAULT, complete

AGENT_CONTEXT = 8192  # tokens: the CLIs' first prompt (~5,200) and their output limit fit
SESSION_TIMEOUT_S = 240.0
OUTPUT_TOKENS = 16  # Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS; Codex: the server's default
BIN = REPO / ".cache" / "agent-clis" / "node_modules" / ".bin"
# What the server's in-band error events say when an injected fault cut a stream after its 200
# header (the engine died: server/chat_bridge.py; the drain aborted it: server/formatting.py; an
# expert read failed: engine/core/faults.py). The CLI shows the message, not the fault class.
IN_BAND_FAULTS = ("The engine failed: ", "(server shutting down)", "expert load failed")
CLAUDE_MODELS = ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_HAIKU_MODEL", "DEFAULT_SONNET_MODEL")


def install() -> None:
    """The pinned CLIs, installed if they are not (tests/agent_cli_install.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "agent_cli_install", REPO / "tests" / "agent_cli_install.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    problem = mod.install()
    if problem:
        raise SystemExit(f"--agent-clis: {problem}")


def long_context_copy(model_dir: Path, into: Path) -> Path:
    """`model_dir` with max_position_embeddings raised to AGENT_CONTEXT (its files linked), or
    `model_dir` itself where its context is that long already."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if int(text.get("max_position_embeddings") or 0) >= AGENT_CONTEXT:
        return model_dir
    text["max_position_embeddings"] = AGENT_CONTEXT
    dst = into / model_dir.name
    dst.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _env(home: Path) -> dict[str, str]:
    """Nothing of the caller's settings or credentials; any connection but loopback fails."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
    }


def _claude(ctx: Ctx, home: Path) -> list[str]:
    env = _env(home) | {
        "ANTHROPIC_BASE_URL": ctx.base_url,
        "ANTHROPIC_API_KEY": "soak",
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(OUTPUT_TOKENS),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        **{f"ANTHROPIC_{k}": ctx.model for k in CLAUDE_MODELS},
    }
    cmd = [str(BIN / "claude"), "-p", "Say hello.", "--output-format", "stream-json", "--verbose"]
    return _run([*cmd, "--disallowedTools", "Read"], env, home, ctx.stopped)


def _codex(ctx: Ctx, home: Path) -> list[str]:
    codex_home = home / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{ctx.model}"\nmodel_provider = "moe"\ncheck_for_update_on_startup = false\n'
        '[analytics]\nenabled = false\n[model_providers.moe]\nname = "moe-offload"\n'
        f'base_url = "{ctx.base_url}/v1"\nwire_api = "responses"\nenv_key = "MOE_KEY"\n'
    )  # the CLI's own retries stay on: a session must get through a fault as a user's would
    env = _env(home) | {"CODEX_HOME": str(codex_home), "MOE_KEY": "soak"}
    cmd = [str(BIN / "codex"), "exec", "--json", "--skip-git-repo-check", "--ephemeral"]
    return _run(
        [*cmd, "-C", str(home), "--disable", "shell_tool", "Say hello."], env, home, ctx.stopped
    )


def _run(cmd: list[str], env: dict[str, str], cwd: Path, stopped: threading.Event) -> list[str]:
    """The CLI's output lines, then its exit code as the last line (`rc=N`; `rc=timeout`;
    `rc=stopped` when the soak stopped first, the server gone after its drain)."""
    with open(cwd / "out.txt", "wb") as out:  # a file: no pipe to drain while it runs
        p = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    while (rc := p.poll()) is None and time.monotonic() < deadline and not stopped.is_set():
        time.sleep(0.2)
    if rc is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    why = str(rc) if rc is not None else "stopped" if stopped.is_set() else "timeout"
    return [*(cwd / "out.txt").read_text(errors="replace").splitlines(), f"rc={why}"]


def _rows(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the CLIs also print plain warnings
        if isinstance(row, dict):
            rows.append(row)
    return rows


def verdict(cli: str, lines: list[str]) -> tuple[str, int | None, str]:
    """(outcome, HTTP status the CLI reported or None, one line of detail) of a finished session."""
    rc, rows = lines[-1].removeprefix("rc="), _rows(lines[:-1])
    if rc == "timeout":
        return "lost", None, f"{cli} ran past {SESSION_TIMEOUT_S:.0f} s"
    if rc == "stopped":  # the server had drained and exited: its next request went nowhere
        return "refused", None, "the soak stopped after the drain"
    if cli == "claude_code":
        result = rows[-1] if rows and rows[-1].get("type") == "result" else None
        if result is None:
            return "lost", None, f"no result row (exit {rc}): {lines[-2:]}"
        status = result.get("api_error_status")
        if status is None and (rc == "0" or result.get("api_error") == "max_output_tokens"):
            return "complete", 200, ""
        return _failed(status, str(result.get("result", ""))[:200])
    turns = [r["type"] for r in rows if str(r.get("type", "")).startswith("turn.")]
    if rc == "0" and turns[-1:] == ["turn.completed"]:
        return "complete", 200, ""
    failed = next((r for r in rows if r.get("type") == "turn.failed"), {})
    message = str(failed.get("error", {}).get("message", lines[-2:]))[:200]
    if any(m in message for m in IN_BAND_FAULTS):  # the server's in-band stream error
        return "fault", None, message
    found = [int(s) for s in ("400", "404", "413", "429", "500", "503", "529") if s in message]
    return _failed(found[0] if found else None, message)


def _failed(status: int | None, detail: str) -> tuple[str, int | None, str]:
    if status is not None and (status >= 500 or status == 429):
        return "fault", status, detail  # the server was restarting, draining or full
    if status is not None:
        return "error", status, detail
    return "lost", None, detail


def agent_session(ctx: Ctx, rng: random.Random) -> None:
    """One Claude Code or Codex CLI session, one turn."""
    cli = rng.choice(["claude_code", "codex"])
    o = ctx.start("agent_cli", cli)
    with tempfile.TemporaryDirectory(prefix="soak-agent-") as tmp:
        lines = (_claude if cli == "claude_code" else _codex)(ctx, Path(tmp))
    complete(o, ctx.clock, True)  # the end time; the verdict below decides the outcome
    o.outcome, o.status, o.detail = verdict(cli, lines)
    if o.outcome == "fault":
        # The CLI reports the status, not the error object's fault class: the summary counts such
        # a 5xx as explained only when it ended while a fault was injected or in the drain.
        o.code = CLI_FAULT
    backoff(o)
