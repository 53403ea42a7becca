"""The maths of `python -m bench serve`: per-request timings to TTFT, TPOT and ITL percentiles,
throughput and goodput, with the definitions vLLM's `bench serve` uses:

- TTFT: from sending the request to its first streamed token.
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1): the mean time per output token after
  the first; requests with one output token have none.
- ITL: every gap between two consecutive streamed chunks, over all requests (a chunk may carry several
  tokens, e.g. under speculative decoding).
- Goodput: requests per second that met every SLO given (TTFT <= --slo-ttft, TPOT <= --slo-tpot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, `sent` from the run's start."""

    ok: bool
    sent: float = 0.0
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int = 0  # as the server's `usage` said (0 when it said nothing)
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default);
    NaN for no values."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """A request counts toward goodput if it finished and met each SLO given (a one-token request has
    no TPOT and meets any TPOT SLO)."""
    if not r.ok:
        return False
    if slo_ttft is not None and not r.ttft <= slo_ttft:
        return False
    return slo_tpot is None or math.isnan(r.tpot) or r.tpot <= slo_tpot


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
) -> dict[str, float]:
    """One rate's figures: counts, throughput, goodput, and p50/p90/p99 (and mean) of TTFT, TPOT and
    ITL in milliseconds. `duration`: from the first send to the last completion, in seconds."""
    done = [r for r in results if r.ok]
    out: dict[str, float] = {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
    }
    per_s = 1 / duration if duration > 0 else math.nan
    out["request_throughput"] = len(done) * per_s
    out["output_throughput"] = out["output_tokens"] * per_s
    good = sum(meets_slo(r, slo_ttft, slo_tpot) for r in done)
    out["goodput"] = good * per_s
    out["slo_attained"] = good / len(results) if results else math.nan
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done],
        "itl": [g for r in done for g in r.itl],
        "e2e": [r.latency for r in done],
    }
    for name, xs in series.items():
        clean = [x for x in xs if not math.isnan(x)]
        out[f"mean_{name}_ms"] = 1e3 * sum(clean) / len(clean) if clean else math.nan
        for q in PERCENTILES:
            out[f"p{q}_{name}_ms"] = 1e3 * percentile(clean, q)
    return out
