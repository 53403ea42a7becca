"""The data a scheduler step passes around: request states, the per-step plan of windows, and what the runner
returns for them (engine/core/scheduler.py decides them; engine/worker/runner.py computes them). Plain data, no
tensors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.messages import GenerateRequest, TokenLogprob


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqState:
    req: GenerateRequest
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_computed: int = 0  # positions already in this request's KV cache
    output_ids: list[int] = field(default_factory=list)
    queue_seconds: float | None = None
    sent_first: bool = False
    num_cached: int = 0  # prompt positions restored from the prefix cache at admission
    preemptions: int = 0  # times its KV was taken back; it recomputes it when resumed

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def fill_ids(self) -> list[int]:
        """The tokens to prefill before decoding: the prompt; after a preemption also every output token
        but the last (the next decode step's input)."""
        if not self.output_ids:
            return self.req.prompt_ids
        return self.req.prompt_ids + self.output_ids[:-1]

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building them (the scheduler asks at every step)."""
        return len(self.req.prompt_ids) + max(len(self.output_ids) - 1, 0)


@dataclass(frozen=True)
class SeqWork:
    """One request's window in a step (plain data: the runner looks up its cache by id)."""

    request_id: str
    input_ids: list[int]  # [T] positions to run
    start_pos: int  # KV cache length before this window
    is_prefill: bool  # the window holds prompt tokens (the first chunk creates the KV cache)
    req: GenerateRequest
    output_ids: tuple[int, ...]  # tokens generated so far (penalties, min_tokens)
    samples: bool = True  # False for a prompt chunk that does not reach the prompt's end
    num_draft: int = 0  # the last num_draft input_ids are proposed tokens to verify
    max_draft: int = 0  # proposals the request can still use (max_tokens and context left)
    draft_probs: object | None = (
        None  # the proposer's distributions [num_draft, V], None = deterministic
    )
    prefix_hit: int = (
        0  # prompt positions the runner restores from the prefix cache before the first chunk
    )
    block_table: tuple[
        int, ...
    ] = ()  # the KV pool's blocks holding this request's positions, in order

    @property
    def new_seq(self) -> bool:
        return self.is_prefill and self.start_pos == self.prefix_hit

    @property
    def draft_ids(self) -> list[int]:
        return self.input_ids[len(self.input_ids) - self.num_draft :] if self.num_draft else []


@dataclass
class StepPlan:
    work: list[SeqWork] = field(default_factory=list)
    free_ids: list[str] = field(
        default_factory=list
    )  # requests whose KV cache/RNG the runner drops
    preempted_ids: list[str] = field(
        default_factory=list
    )  # requests whose KV cache the runner drops (their RNG and grammar stay): they resume later


@dataclass
class SeqResult:
    sampled: list[int] = field(default_factory=list)  # new tokens: accepted proposals + one sampled
    num_kept: int | None = None  # window positions kept in the KV cache; None = all of them
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


@dataclass
class StepOutput:
    results: dict[str, SeqResult] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the runner's execute (cost measurements, e.g. adaptive k)
