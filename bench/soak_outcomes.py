"""What happened to one soak request: complete, a clear error, cut by an injected fault, or lost.

Every request the soak sends ends in one `Outcome`:

- `complete`: a whole answer (a non-streamed body with its choices / content, or a stream that
  reached its end marker: `[DONE]`, `message_stop`, `response.completed`);
- `error`: a clear error object in its API's shape with a status, for a cause that is not an
  injected fault (an oversized body's 413, a full queue's 429 / 503 `queue_full`);
- `fault`: a clear error object whose fault class names an injected fault (`engine_restarted`,
  `engine_restarting` after a SIGKILL; `shutting_down`, `aborted` during the SIGTERM drain;
  `expert_read_failed` after an injected EIO);
- `refused`: during the drain, the server never took the request: the connection was refused
  (the listener closed), or a kept-alive one was closed before any byte of a response;
- `disconnected`: the client itself went away mid-stream, as planned;
- `lost`: anything else: a timeout, a cut connection, a body that is not an error object, a
  stream without its end marker. The acceptance asks for none.

A 5xx is "unexplained" when its fault class is not one of FAULT_CODES.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import anthropic
import httpx
import openai

# Fault classes an injected fault explains: SIGKILL of the engine, SIGTERM drain of the server,
# an expert read error.
KILL_CODES = frozenset({"engine_restarted", "engine_restarting"})
DRAIN_CODES = frozenset({"shutting_down", "aborted"})
READ_CODES = frozenset({"expert_read_failed"})  # an injected EIO (--read-faults)
FAULT_CODES = KILL_CODES | DRAIN_CODES | READ_CODES
# An agent CLI that gave up on a 5xx shows the status, not the fault class (bench/soak_agents.py):
# explained only by the time it ended (bench/soak_summary.py), so not one of FAULT_CODES.
CLI_FAULT = "agent_cli_api_error"
OUTCOMES = ("complete", "error", "fault", "refused", "disconnected", "lost")


@dataclass
class Outcome:
    client: str  # which client sent it (openai_chat, anthropic, ...)
    kind: str  # what it asked for (chat_stream, tools, count_tokens, ...)
    t0: float  # seconds since the soak began
    t1: float = 0.0
    outcome: str = "lost"
    status: int | None = None  # HTTP status (200 for an in-band stream error)
    code: str | None = None  # the fault class / error code the server named
    detail: str = ""  # for a lost request: what went wrong, one line

    @property
    def unexplained_5xx(self) -> bool:
        return self.status is not None and self.status >= 500 and self.code not in FAULT_CODES

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Clock:
    """Seconds since the soak began, and whether the SIGTERM drain has begun."""

    start: float = field(default_factory=time.monotonic)
    draining: bool = False

    def now(self) -> float:
        return time.monotonic() - self.start


def code_of(body: Any) -> tuple[str | None, bool]:
    """(the error code / fault class, whether `body` is an error object of either API)."""
    if not isinstance(body, dict):
        return None, False
    err = body.get("error") if isinstance(body.get("error"), dict) else body
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None, False
    code = err.get("code") if isinstance(err.get("code"), str) else None
    return code or (err.get("type") if isinstance(err.get("type"), str) else None), True


def settle(o: Outcome, clock: Clock, status: int | None, body: Any) -> Outcome:
    """Fill `o` from an error answer: `status` (None: in-band stream error) and its body."""
    o.t1, o.status = clock.now(), status if status is not None else 200
    o.code, shaped = code_of(body)
    if not shaped:
        o.outcome, o.detail = "lost", f"not an error object: {str(body)[:200]}"
    elif o.code in FAULT_CODES:
        o.outcome = "fault"
    else:
        o.outcome = "error"
    return o


def _refused(e: BaseException | None) -> bool:
    """Whether the server never took the request: the connection was refused, or a kept-alive
    connection was closed before any byte of a response (the server closing its idle
    connections as it exits; the SDKs retry both by default).  The SDKs wrap their own httpx
    fork's errors (httpx2), so the chain of causes is walked by class name."""
    while e is not None:
        if isinstance(e, ConnectionRefusedError) or type(e).__name__ == "ConnectError":
            return True
        if "without sending a response" in str(e):  # httpx's RemoteProtocolError for that case
            return True
        e = e.__cause__ or e.__context__
    return False


def from_exception(o: Outcome, clock: Clock, e: BaseException) -> Outcome:
    """Classify an exception an SDK or httpx raised for request `o`."""
    o.t1 = clock.now()
    if isinstance(e, (openai.APIStatusError, anthropic.APIStatusError)):
        return settle(o, clock, e.status_code, e.body)
    if isinstance(e, (openai.APITimeoutError, anthropic.APITimeoutError, httpx.TimeoutException)):
        o.outcome, o.detail = "lost", f"timed out ({type(e).__name__})"
        return o
    if _refused(e) and clock.draining:
        o.outcome, o.detail = "refused", f"not taken during the drain: {str(e)[:100]}"
        return o
    if isinstance(e, (openai.APIError, anthropic.APIError)) and getattr(e, "body", None):
        return settle(o, clock, None, e.body)  # an in-band stream error
    o.outcome, o.detail = "lost", f"{type(e).__name__}: {str(e)[:200]}"
    return o


def complete(o: Outcome, clock: Clock, ok: bool, why: str = "") -> Outcome:
    o.t1, o.status = clock.now(), 200
    o.outcome = "complete" if ok else "lost"
    o.detail = "" if ok else why
    return o
