"""The soak's numbers from its raw record: counts per client and outcome, per fault, lost
requests, unexplained 5xx, RSS slope, fd and thread ranges and growth, /health latency, restart
times."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench.soak_outcomes import (
    CLI_FAULT,
    DRAIN_CODES,
    FAULT_CODES,
    KILL_CODES,
    OUTCOMES,
    READ_CODES,
)

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


def _growth(steady: list[dict[str, Any]], key: str) -> float | None:
    """How much `key` grew over the steady samples' span, by its least-squares slope."""
    pts = [(s["t"], s[key]) for s in steady if s[key] is not None]
    slope = slope_per_minute([t for t, _ in pts], [y for _, y in pts])
    if slope is None:
        return None
    return slope * (pts[-1][0] - pts[0][0]) / 60.0


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
        # Fitted growth over the steady span: a leak of one fd or thread a run shows as >= 1.
        "fds_growth": _growth(steady, "fds"),
        "threads_growth": _growth(steady, "threads"),
        "engine_rss_mib_range": _range([s["engine_rss_mib"] for s in steady]),
        "waiting_max": max((s["waiting"] or 0 for s in steady), default=None),
        "health_p50_ms": percentile(answered, 0.5),
        "health_p99_ms": percentile(answered, 0.99),
        "health_max_ms": max(answered, default=None),
        "health_unanswered": len(health) - len(answered),
    }


WINDOW_MARGIN_S = 5.0  # a request cut by a fault ends at most this long after serving resumed


def fault_windows(raw: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start, end, fault) of each fault that restarts the engine: the SIGKILLs and the faults of
    bench/soak_faults.py, from their start until serving again (plus WINDOW_MARGIN_S)."""
    out = []
    for k in raw["kills"]:
        out.append((k["t"], k["t"] + (k["restart_s"] or 60.0), "engine_sigkill"))
    for f in raw.get("faults", []):
        out.append((f["t"], f["t"] + (f["serving_s"] or 100.0), f["kind"]))
    return sorted((t0, t1 + WINDOW_MARGIN_S, name) for t0, t1, name in out)


def _fault_of(
    r: dict[str, Any], windows: list[tuple[float, float, str]], drain_t: float
) -> str | None:
    """The injected fault that explains request `r`'s error, or None."""
    # The latest fault that began before the request ended and whose window holds that end.
    found = [name for t0, t1, name in windows if t0 <= r["t1"] <= t1]
    if r["code"] in KILL_CODES:
        return found[-1] if found else "engine_sigkill"
    if r["code"] == CLI_FAULT:  # an agent CLI's 5xx: by its time alone
        return found[-1] if found else "sigterm_drain" if r["t1"] >= drain_t else None
    if r["code"] in DRAIN_CODES:
        return "sigterm_drain"
    if r["code"] in READ_CODES:
        return "expert_read_eio"
    return None


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    reqs = raw["requests"]
    windows = fault_windows(raw)
    per_client: dict[str, dict[str, int]] = {}
    for r in reqs:
        row = per_client.setdefault(r["client"], dict.fromkeys(OUTCOMES, 0))
        row[r["outcome"]] += 1
    drain_t = raw["drain"]["t"]
    fault = {id(r): _fault_of(r, windows, drain_t) for r in reqs}
    per_client_fault: dict[str, dict[str, int]] = {}
    for r in reqs:
        if (f := fault[id(r)]) is not None:
            row = per_client_fault.setdefault(r["client"], {})
            row[f] = row.get(f, 0) + 1
    unexplained = [
        r
        for r in reqs
        if r["status"] and r["status"] >= 500 and r["code"] not in FAULT_CODES and not fault[id(r)]
    ]
    lost = [r for r in reqs if r["outcome"] == "lost"]
    restarts = [k["restart_s"] for k in raw["kills"]]
    # A client recovered when it completed a request after the last fault's restart was done: its end,
    # not its start, after it (an agent CLI's session runs tens of seconds, so one that began while the
    # engine restarted and ended served is the recovery; asking for a start after it raced the drain).
    back = max((t1 - WINDOW_MARGIN_S for _, t1, _ in windows), default=0.0)
    recovered = {
        c: any(
            r["client"] == c
            and r["outcome"] in ("complete", "error", "disconnected")
            and r["t1"] >= back
            for r in reqs
        )
        for c in per_client
    }
    return {
        "requests": len(reqs),
        "requests_per_second": len(reqs) / max(raw["drain"]["t"], 1e-9),
        "outcomes": dict(Counter(r["outcome"] for r in reqs)),
        "per_client": per_client,
        "per_fault": dict(Counter(f for f in fault.values() if f is not None)),
        "per_client_fault": per_client_fault,
        "faults": raw.get("faults", []),
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
