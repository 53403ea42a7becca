"""The soak's numbers from its raw record: counts per client and outcome, per fault, lost
requests, unexplained 5xx, RSS slope, fd and thread ranges, /health latency, restart times."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench.soak_outcomes import DRAIN_CODES, FAULT_CODES, KILL_CODES, OUTCOMES, READ_CODES

WARMUP_FRACTION = 0.2  # samples before this share of the run are warm-up (first loads, caches)


def slope_per_minute(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over ts, in units of y per minute."""
    if len(ts) < 3:
        return None
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _range(xs: list[Any]) -> list[Any] | None:
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def _samples(raw: dict[str, Any]) -> dict[str, Any]:
    """Over-time figures: after warm-up and before the drain (the server is exiting then)."""
    end = raw["drain"]["t"]
    warm = WARMUP_FRACTION * end
    steady = [s for s in raw["samples"] if warm <= s["t"] < end]
    rss = [(s["t"], s["rss_mib"]) for s in steady if s["rss_mib"] is not None]
    # Every probe of /health (bench/soak_health.py) where the record has them, else the samples'.
    probes = raw.get("health") or [[s["t"], s["health_ms"], s["health"]] for s in raw["samples"]]
    health = [ms for t, ms, _ in probes if t < end]
    answered = [h for h in health if h is not None]
    return {
        "samples": len(raw["samples"]),
        "health_probes": len(health),
        "rss_mib_range": _range([y for _, y in rss]),
        "rss_slope_mib_per_min": slope_per_minute([t for t, _ in rss], [y for _, y in rss]),
        "fds_range": _range([s["fds"] for s in steady]),
        "threads_range": _range([s["threads"] for s in steady]),
        "engine_rss_mib_range": _range([s["engine_rss_mib"] for s in steady]),
        "waiting_max": max((s["waiting"] or 0 for s in steady), default=None),
        "health_p50_ms": percentile(answered, 0.5),
        "health_p99_ms": percentile(answered, 0.99),
        "health_max_ms": max(answered, default=None),
        "health_unanswered": len(health) - len(answered),
    }


def _fault_of(r: dict[str, Any]) -> str | None:
    if r["code"] in KILL_CODES:
        return "engine_sigkill"
    if r["code"] in DRAIN_CODES:
        return "sigterm_drain"
    if r["code"] in READ_CODES:
        return "expert_read_eio"
    return None


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    reqs = raw["requests"]
    per_client: dict[str, dict[str, int]] = {}
    for r in reqs:
        row = per_client.setdefault(r["client"], dict.fromkeys(OUTCOMES, 0))
        row[r["outcome"]] += 1
    unexplained = [
        r for r in reqs if r["status"] and r["status"] >= 500 and r["code"] not in FAULT_CODES
    ]
    lost = [r for r in reqs if r["outcome"] == "lost"]
    restarts = [k["restart_s"] for k in raw["kills"]]
    # A client recovered when it completed a request after the last restart was done.
    back = max((k["t"] + (k["restart_s"] or 0) for k in raw["kills"]), default=0.0)
    recovered = {
        c: any(
            r["client"] == c
            and r["outcome"] in ("complete", "error", "disconnected")
            and r["t0"] >= back
            for r in reqs
        )
        for c in per_client
    }
    return {
        "requests": len(reqs),
        "requests_per_second": len(reqs) / max(raw["drain"]["t"], 1e-9),
        "outcomes": dict(Counter(r["outcome"] for r in reqs)),
        "per_client": per_client,
        "per_fault": dict(Counter(f for r in reqs if (f := _fault_of(r)) is not None)),
        "codes": dict(Counter(f"{r['status']} {r['code']}" for r in reqs if r["code"])),
        "lost": len(lost),
        "lost_examples": [{k: r[k] for k in ("client", "kind", "t0", "detail")} for r in lost[:10]],
        "unexplained_5xx": len(unexplained),
        "unexplained_examples": [
            {k: r[k] for k in ("client", "kind", "status", "code")} for r in unexplained[:10]
        ],
        "kills": len(raw["kills"]),
        "recovered_after_last_kill": recovered,
        "restart_s": restarts,
        "restart_max_s": max((x for x in restarts if x is not None), default=None),
        "drain_s": raw["drain"]["seconds"],
        "exit_code": raw["drain"]["exit_code"],
        **_samples(raw),
    }
