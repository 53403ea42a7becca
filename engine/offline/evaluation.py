"""Teacher-forced perplexity under a miss policy, decoding token by token.

Why token by token: a batched prefill would route all positions against one cache state
and hide the cache dynamics that the policies act on. Feeding one token per step makes
the fast tier evolve exactly as it does while generating, so the perplexity measured
here is the perplexity a user of that policy actually gets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from engine.worker.kv_cache import new_kv_cache
from engine.worker.loaded_model import OffloadedModel
from engine.worker.runner import ModelRunner


@dataclass(frozen=True)
class EvalResult:
    policy: str
    tokens: int  # predicted tokens
    nll: float  # mean negative log-likelihood, nats
    seconds: float
    expert_calls: int
    calls_hit: int
    calls_fetched: int
    calls_substituted: int
    substituted_mass: float  # summed over token-layers
    admissions: int
    bytes_moved: int
    stall_seconds: float
    token_layers: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def substitution_rate(self) -> float:
        return self.calls_substituted / self.expert_calls if self.expert_calls else 0.0

    @property
    def mean_substituted_mass(self) -> float:
        """Mean substituted gate mass per token-layer."""
        return self.substituted_mass / self.token_layers if self.token_layers else 0.0

    @property
    def fetches_per_token(self) -> float:
        return self.calls_fetched / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            ppl=self.ppl,
            substitution_rate=self.substitution_rate,
            mean_substituted_mass=self.mean_substituted_mass,
            fetches_per_token=self.fetches_per_token,
        )
        return d


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Split a token stream into consecutive context windows (each scored from its 2nd token)."""
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]


@torch.inference_mode()
def score_window(
    runner: ModelRunner, chunk: list[int], on_token: Callable[[], object] = lambda: None
) -> float:
    """Summed NLL of chunk[1:], feeding one token per step through a fresh KV cache, with the
    same runner forward (packed attention, MoE path) that generation uses."""
    cache = new_kv_cache(runner.lm.config)
    total = 0.0
    for pos in range(len(chunk) - 1):
        logits = runner.forward([[chunk[pos]]], [pos], [cache], [[0]])[0][0].float()  # [V]
        total -= F.log_softmax(logits, dim=-1)[chunk[pos + 1]].item()
        on_token()
    return total


@torch.inference_mode()
def teacher_forced_eval(
    om: OffloadedModel, ids: list[int], window: int = 256, label: str = "", progress: bool = True
) -> EvalResult:
    om.stats.reset()
    runner = ModelRunner(om)
    nll_sum, n = 0.0, 0
    t0 = time.perf_counter()
    chunks = windows(ids, window)
    bar = tqdm(
        total=sum(len(c) - 1 for c in chunks),
        desc=f"eval {label}".strip(),
        unit="tok",
        disable=not progress,
        leave=False,
    )
    for chunk in chunks:
        nll_sum += score_window(runner, chunk, bar.update)
        n += len(chunk) - 1
    bar.close()
    s = om.stats.snapshot()
    return EvalResult(
        policy=label or om.engine_config.policy,
        tokens=n,
        nll=nll_sum / max(n, 1),
        seconds=time.perf_counter() - t0,
        expert_calls=s["calls_hit"] + s["calls_fetched"] + s["substitutions"],
        calls_hit=s["calls_hit"],
        calls_fetched=s["calls_fetched"],
        calls_substituted=s["substitutions"],
        substituted_mass=s["substituted_mass"],
        admissions=s["admissions"],
        bytes_moved=s["bytes_moved"],
        stall_seconds=s["stall_seconds"],
        token_layers=n * len(om.moe_layers),  # one forward step per predicted token
    )


@torch.inference_mode()
def reference_nll(model: torch.nn.Module, ids: list[int], window: int = 256) -> tuple[float, int]:
    """Mean NLL of a plain transformers model over the same windows, one batched forward each."""
    total, n = 0.0, 0
    for chunk in windows(ids, window):
        logits = model(torch.tensor([chunk])).logits[0, :-1].float()
        total += F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        n += len(chunk) - 1
    return total / n, n
