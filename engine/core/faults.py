"""Per-request faults: what the client is told, and what the log keeps.

A fault that belongs to one sequence (its sampling, grammar, detokenization, a proposer's
window for it, an expert read only it needed) ends that sequence with `finish_reason="error"`;
the rest of the batch and the engine go on. The client sees one short line and an error id;
the traceback goes to the log at error level under the same id, so an operator can find it
and nothing about the server's files, modules or layout reaches a response.
"""

from __future__ import annotations

import logging
import re
import uuid

from engine.errors import MoeOffloadError

log = logging.getLogger("moe_offload.engine")


def new_error_id() -> str:
    """A short random id that ties a response to its log entry."""
    return "err-" + uuid.uuid4().hex[:16]


# A path starts where a word starts (never inside one, which left `models/a/b.py` as `modelsb.py`):
# an absolute one (`/srv/x`, `C:\\x`, `\\\\host\\x`) of any depth, or a relative one whose last part
# is a file name with an extension (`models/embedded/model.safetensors`), so prose such as
# "user/assistant/user/..." stays as it is.  Groups `abs` and `rel` hold the last part, all that is kept.
_SEG = r"[^\\/\s'\"]+"
_PATH = re.compile(
    rf"(?<![^\s'\"(\[=,:])"
    rf"(?:(?:[A-Za-z]:)?[\\/]+(?:{_SEG}[\\/]+)*(?P<abs>{_SEG})"
    rf"|(?:{_SEG}[\\/]+)+(?P<rel>[\w-][^\\/\s'\"]*\.[A-Za-z]\w*))"
)
_SAFE = (ValueError, MoeOffloadError, OSError)  # our checks, our one-line errors, I/O errors


def redact(text: str) -> str:
    """First line of `text`, at most 300 characters, with every path cut to its file name."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return _PATH.sub(lambda m: m.group("abs") or m.group("rel"), line)[:300]


def describe(e: BaseException) -> str:
    """One line about `e` that is safe to show a client: the messages of our own checks
    (ValueError, MoeOffloadError) and I/O errors with paths cut to file names, and of a lost
    expert with its cause; only the exception's type for anything else, whose text may name
    internals."""
    layer, expert = getattr(e, "layer", None), getattr(e, "expert", None)
    if isinstance(layer, int) and isinstance(
        expert, int
    ):  # ExpertLoadError (engine/experts is not imported here)
        cause = e.__cause__
        why = f" ({type(cause).__name__}: {redact(str(cause))})" if isinstance(cause, _SAFE) else ""
        return f"expert {expert} of layer {layer} could not be loaded{why}"
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__}: {e.strerror}"
    if isinstance(e, (ValueError, MoeOffloadError)) and str(e):
        return redact(str(e))
    return f"internal error ({type(e).__name__})"


def request_fault(stage: str, request_id: str, e: BaseException) -> str:
    """Log `e` with its traceback under a new error id; return the message for the request."""
    eid = new_error_id()
    log.error("request %s failed in %s [error id %s]", request_id, stage, eid, exc_info=e)
    return f"{stage} failed for this request: {describe(e)} (error id {eid})"


# The stage a request_fault names -> the fault class its error object carries as `code`.
FAULT_CLASSES = {
    "expert load": "expert_read_failed",
    "the forward pass": "forward_failed",
    "sampling": "sampling_failed",
    "the grammar": "grammar_failed",
    "proposing": "proposer_failed",
    "detokenization": "detokenization_failed",
}


def fault_class(error: str | None) -> str:
    """The fault class of a request_fault message (`engine_error` for any other text)."""
    for stage, code in FAULT_CLASSES.items():
        if error is not None and error.startswith(f"{stage} failed"):
            return code
    return "engine_error"
