"""The soak's Schemathesis client: requests generated from the server's own /openapi.json.

Each step is one Schemathesis round (bench/api_fuzz.py's `run_schemathesis`: every operation,
EXAMPLES cases each, a new seed a round) while the other clients and the faults go on; every
exchange of its HAR report becomes one Outcome. Each request may take TIMEOUT_S (60 s), as the
other clients' may (Schemathesis's own default, 10 s, cut long generations under the soak's load). A 2xx is `complete` (a stream too, unless it
carries an error event, which is settled like any error); a 4xx/5xx is settled by its error object
(bench/soak_outcomes.py); an answer that reveals internals (api_fuzz.LEAKS: a traceback, a source
file, a machine path) is `lost`, whatever its status. Schemathesis's own verdict is not used: it
calls every 5xx a failure, the soak asks whether each was a clear error naming its fault.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.api_fuzz import LEAKS, run_schemathesis
from bench.soak_clients import TIMEOUT_S, Ctx
from bench.soak_outcomes import Outcome, complete, settle

EXAMPLES = 3  # cases per operation and round: a round is then a few dozen requests
ROUND_TIMEOUT_S = 300.0


def _stream_error(body: str) -> dict[str, Any] | None:
    """The error object of an SSE body's error event, if it has one."""
    for line in body.splitlines():
        if line.startswith("data: ") and '"error"' in line:
            try:
                event = json.loads(line[6:])
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                return event  # {"error": {...}} or a flat {"type": "error", "message": ...}
    return None


# /health's states -> the fault class that explains a 503 in each (server/app.py's /health).
HEALTH_CODES = {"restarting": "engine_restarting", "draining": "shutting_down"}


def _health(o: Outcome, ctx: Ctx, status: int, body: str) -> Outcome:
    """/health answers with its own shape, {"status": ...}, not an error object."""
    try:
        state = json.loads(body).get("status")
    except (ValueError, AttributeError):
        state = None
    if not isinstance(state, str):
        o.outcome, o.status, o.detail = "lost", status, f"not a health answer: {body[:200]}"
        return o
    complete(o, ctx.clock, True)
    o.status, o.code = status, (HEALTH_CODES.get(state, state) if status != 200 else None)
    if status != 200:
        o.outcome = "fault" if o.code in HEALTH_CODES.values() else "error"
    return o


def _reveals(path: str, status: int, ctype: str, body: str) -> bool:
    """Whether an answer reveals internals, read as api_fuzz.leaks_in reads it: error bodies and
    /health whole, a stream's error events, nothing else (/metrics' label values are its own)."""
    if status >= 400 or path == "/health":
        return bool(LEAKS.search(body))
    if ctype.startswith("text/event-stream"):
        return any(LEAKS.search(ln) for ln in body.splitlines() if '"error"' in ln)
    return False


def outcome_of(o: Outcome, ctx: Ctx, entry: dict[str, Any], log: str = "") -> Outcome:
    """Settle `o` from one HAR entry; `log` is the round's Schemathesis output (for an entry
    without a response, the line that says why)."""
    status = entry["response"]["status"]
    content = entry["response"].get("content", {})
    body, ctype = content.get("text", "") or "", content.get("mimeType", "")
    path = httpx.URL(entry["request"]["url"]).path
    if status == 0:  # no answer at all: refused in the drain, or a cut connection
        o.outcome = "refused" if ctx.clock.draining else "lost"
        at = log.find("ERRORS")  # Schemathesis's section on requests that got no answer
        why = " ".join(log[at : at + 600].split()) if at >= 0 else "Schemathesis says no more"
        o.detail = f"no response: {why}"
        return o
    if path == "/health" and entry["request"]["method"] == "GET":
        _health(o, ctx, status, body)
    elif status < 400:
        err = _stream_error(body) if ctype.startswith("text/event-stream") else None
        if err is not None:
            settle(o, ctx.clock, None, err)
        else:
            complete(o, ctx.clock, True)
    else:
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            parsed = body
        settle(o, ctx.clock, status, parsed)
    if _reveals(path, status, ctype, body):
        o.outcome, o.detail = "lost", f"reveals internals: {body[:200]}"
    return o


def schemathesis_round(ctx: Ctx, rng: random.Random) -> None:
    """One Schemathesis round against the soak's server; one Outcome per exchange."""
    seed = rng.randrange(1, 2**31)
    offset = time.time() - ctx.clock.now()  # wall clock -> soak seconds
    with tempfile.TemporaryDirectory(prefix="soak-schemathesis-") as tmp:
        har = Path(tmp) / "round.har"
        try:
            log = run_schemathesis(
                ctx.base_url, EXAMPLES, har, seed, ROUND_TIMEOUT_S, request_timeout=TIMEOUT_S
            ).stdout
        except Exception as e:  # noqa: BLE001 - a round cut by its timeout still wrote what it sent
            log = f"the round failed: {type(e).__name__}"
        try:
            entries = json.loads(har.read_text())["log"]["entries"]
        except (OSError, ValueError, KeyError):
            entries = []
    for e in entries:
        path = httpx.URL(e["request"]["url"]).path
        t0 = datetime.fromisoformat(e["startedDateTime"]).timestamp() - offset
        o = Outcome("schemathesis", f"{e['request']['method']} {path}", t0)
        ctx.records.append(o)
        outcome_of(o, ctx, e, log)
        o.t1 = t0 + max(0.0, float(e.get("time") or 0.0)) / 1000
    if not entries:
        time.sleep(1.0)  # a round that sent nothing (the server is gone): do not spin
