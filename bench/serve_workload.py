"""The pure parts of `python -m bench serve`: arrival schedules and the two workloads.

Arrivals: `arrivals(n, rate, kind)` gives n send times (seconds from the start). Poisson arrivals have
exponential gaps of mean 1/rate (what vLLM's `bench serve` and SGLang's `bench_serving` call request rate);
constant arrivals are evenly spaced; rate `inf` sends everything at once.

Workloads are lists of sessions. `chat`: one session per request, one short user message each. `agent`:
N sessions that all share one long system prompt (instructions plus a tool list, as a coding agent sends),
each with several turns; a turn's messages are the whole history so far (earlier user messages and the
server's own replies) plus a new user message (a tool result), so the prompt grows turn by turn and its
prefix is what the server saw last turn. A session's turns run one after another; request k of the schedule
is turn k // N of session k % N, sent at its scheduled time or when that session's previous turn finished,
whichever is later.

Prompt sizes are in words of a text file, not tokens: the benchmark talks to any OpenAI-compatible URL and
owns no tokenizer. The report gives the token counts the servers return in `usage`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

# A tool list in the shape of the OpenAI `tools` field, written into the system prompt as text (not sent
# as `tools`, which some servers reject without a tool-capable chat template): what an agent's prompt holds.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": f"the {arg}"}},
                "required": [arg],
            },
        },
    }
    for name, desc, arg in (
        ("read_file", "Read a file of the repository and return its text.", "path"),
        ("write_file", "Replace a file's text with new text.", "path"),
        ("run_shell", "Run a shell command in the repository and return its output.", "command"),
        ("search", "Search the repository for a regular expression.", "pattern"),
        ("list_dir", "List the entries of a directory.", "path"),
    )
]


def arrivals(n: int, rate: float, kind: str = "poisson", seed: int = 0) -> list[float]:
    """n send times in seconds from the start, non-decreasing; the first request goes at 0."""
    if n < 0 or not rate > 0:
        raise ValueError(f"need n >= 0 and rate > 0, got n={n}, rate={rate}")
    if math.isinf(rate):
        return [0.0] * n
    if kind == "constant":
        return [i / rate for i in range(n)]
    if kind != "poisson":
        raise ValueError(f"unknown arrival kind {kind!r} (poisson or constant)")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def parse_rates(text: str) -> list[float]:
    """'0.5,1,2,inf' -> [0.5, 1.0, 2.0, inf]; every rate positive."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


@dataclass
class Session:
    """One conversation: an optional system prompt and the user messages of its turns, in order."""

    system: str | None
    users: list[str]
    history: list[dict[str, str]] = field(default_factory=list)  # filled as the turns run

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The request body's messages for `turn`: system, the history so far, the new user message."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": self.users[turn]}]

    def record(self, turn: int, reply: str) -> None:
        """Keep the turn in the history so the next turn's prompt extends this one's."""
        self.history += [
            {"role": "user", "content": self.users[turn]},
            {"role": "assistant", "content": reply},
        ]


class Words:
    """Consecutive runs of words cut from a text file, wrapping around at its end."""

    def __init__(self, text: str, seed: int = 0) -> None:
        self.words = text.split()
        if not self.words:
            raise ValueError("the text file has no words")
        self.pos = random.Random(seed).randrange(len(self.words))

    @classmethod
    def from_file(cls, path: str | Path, seed: int = 0) -> Words:
        return cls(Path(path).read_text(encoding="utf-8"), seed)

    def take(self, n: int) -> str:
        out = [self.words[(self.pos + i) % len(self.words)] for i in range(n)]
        self.pos = (self.pos + n) % len(self.words)
        return " ".join(out)


def chat_workload(words: Words, requests: int, prompt_words: int) -> list[Session]:
    """`requests` one-turn sessions, each a distinct short user message."""
    return [
        Session(None, [f"Continue the text: {words.take(prompt_words)}"]) for _ in range(requests)
    ]


def agent_workload(
    words: Words, sessions: int, turns: int, system_words: int, turn_words: int
) -> list[Session]:
    """`sessions` sessions sharing one system prompt of about `system_words` words plus the tool list;
    each turn adds a user message of `turn_words` words (a tool result)."""
    system = (
        "You are a coding agent working in a repository. Call a tool by answering with JSON "
        f"naming it and its arguments. Tools: {json.dumps(TOOLS)}\nProject notes: "
        + words.take(system_words)
    )
    return [
        Session(
            system,
            [f"Tool result (turn {t}): {words.take(turn_words)}" for t in range(turns)],
        )
        for _ in range(sessions)
    ]


def schedule(sessions: list[Session], times: list[float]) -> list[list[float]]:
    """Each session's turn send times: `times` taken in order, round-robin over the sessions turn by
    turn (with equal turn counts, request k is turn k // len(sessions) of session k % len(sessions))."""
    need = sum(len(s.users) for s in sessions)
    if len(times) < need:
        raise ValueError(f"{need} turns but {len(times)} arrival times")
    out: list[list[float]] = [[] for _ in sessions]
    k = 0
    for turn in range(max((len(s.users) for s in sessions), default=0)):
        for i, s in enumerate(sessions):
            if turn < len(s.users):
                out[i].append(times[k])
                k += 1
    return out
