"""docs/benchmarks/soak.md and its plots over time, from a soak's raw record (bench/soak.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.soak_outcomes import OUTCOMES
from bench.soak_summary import WARMUP_FRACTION

READING = "## Reading of this run"  # a hand-written section from here to the end is kept on rerun
PLOTS = (  # (file, title, sample keys, y label)
    ("soak_memory.png", "Front-end and engine RSS", ("rss_mib", "engine_rss_mib"), "MiB"),
    ("soak_handles.png", "Front-end open fds and threads", ("fds", "threads"), "count"),
    ("soak_health.png", "/health latency", ("health_ms",), "ms"),
    ("soak_queue.png", "Engine requests running and waiting", ("running", "waiting"), "requests"),
    (
        "soak_kv.png",
        "KV pool blocks in use and cached",
        ("kv_blocks.in_use", "kv_blocks.cached"),
        "blocks",
    ),
    (
        "soak_split.png",
        "One budget split: KV pool and expert slots",
        ("memory_split.kv", "memory_split.experts"),
        "bytes",
    ),
)


NOT_COVERED = (  # the end of the page: what issue 53 asks that the soak does not do yet
    "## What the soak does not cover yet",
    "",
    "- Ray Serve and the Kubernetes manifests are checked by tests, not soaked: "
    "tests/test_ray_serve.py (slow set: two replicas behind Ray's proxy, the OpenAI SDK through "
    "it) and tests/test_k8s_manifests.py (every manifest against the Kubernetes schemas, strict).",
    "",
)
FAULT_COLOURS = {"memory_cgroup": "orange", "disk_full": "purple"}


def _value(sample: dict[str, Any], key: str) -> Any:
    """A sample's value at `key`; "kv_blocks.in_use" reads one label of a labelled gauge."""
    name, _, label = key.partition(".")
    value = sample.get(name)
    return (value or {}).get(label) if label else value


def plot(raw: dict[str, Any], out: Path) -> list[str]:
    """One PNG per row of PLOTS; SIGKILLs as red lines, the drain as a black one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = raw["samples"]
    written = []
    for name, title, keys, unit in PLOTS:
        fig, ax = plt.subplots(figsize=(8, 3))
        for key in keys:
            pts = [(s["t"], _value(s, key)) for s in samples if _value(s, key) is not None]
            ax.plot([t for t, _ in pts], [y for _, y in pts], label=key, linewidth=1)
        for k in raw["kills"]:
            ax.axvline(k["t"], color="red", linestyle=":", linewidth=1)
        for f in raw.get("faults", []):
            ax.axvline(f["t"], color=FAULT_COLOURS.get(f["kind"], "grey"), linestyle=":")
        ax.axvline(raw["drain"]["t"], color="black", linestyle="--", linewidth=1)
        ax.set(
            title=title,
            xlabel="s (red: SIGKILL, orange: cgroup shrunk, purple: disk full, black: SIGTERM)",
            ylabel=unit,
        )
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(name)
    return written


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _table(s: dict[str, Any]) -> list[str]:
    lines = [
        "| client | " + " | ".join(OUTCOMES) + " | total |",
        "|---" * (len(OUTCOMES) + 2) + "|",
    ]
    for client, row in sorted(s["per_client"].items()):
        cells = " | ".join(str(row[o]) for o in OUTCOMES)
        lines.append(f"| {client} | {cells} | {sum(row.values())} |")
    return lines


def _r(xs: list[float] | None) -> str:
    return "n/a" if not xs else f"{_fmt(xs[0])} to {_fmt(xs[1])}"


def _acceptance(raw: dict[str, Any]) -> list[str]:
    """Issue 53's acceptance, each against what this run measured."""
    s = raw["summary"]
    slope, p99, back = s["rss_slope_mib_per_min"], s["health_p99_ms"], s["restart_max_s"]
    rows = [
        ("load", "30 min", f"{_fmt(raw['duration_s'] / 60)} min", raw["duration_s"] >= 1800),
        ("requests", ">= 10,000", str(s["requests"]), s["requests"] >= 10_000),
        ("lost", "0", str(s["lost"]), s["lost"] == 0),
        ("5xx not explained by a fault", "0", str(s["unexplained_5xx"]), s["unexplained_5xx"] == 0),
        (
            "every client recovers",
            "all",
            str(sum(s["recovered_after_last_kill"].values()))
            + f" of {len(s['recovered_after_last_kill'])}",
            all(s["recovered_after_last_kill"].values()),
        ),
        (
            "front-end RSS slope after warm-up",
            "<= 1 MiB/min",
            f"{_fmt(slope, 2)} MiB/min",
            slope is not None and slope <= 1.0,
        ),
        _handles_row(s),
        ("/health p99", "<= 100 ms", f"{_fmt(p99)} ms", p99 is not None and p99 <= 100),
        _idle_row(raw.get("idle")),
        (
            "serving again after each SIGKILL",
            "<= 10 s",
            f"{_fmt(back)} s (worst)",
            back is not None and back <= 10,
        ),
    ]
    out = ["| criterion | target | measured | met |", "|---|---|---|---|"]
    for name, target, got, met in rows:
        out.append(
            f"| {name} | {target} | {got} | {'see below' if met is None else 'yes' if met else '**no**'} |"
        )
    return out


# Flat: the fitted growth of open fds and of threads over the steady span stays below this. The
# clients' connections come and go (a 10-minute run: fds 23 to 36, fitted growth -0.8), while a
# handle leaked per engine restart (5 or more in a long run) or per request would pass it.
FLAT_GROWTH = 3.0


def _handles_row(s: dict[str, Any]) -> tuple[str, str, str, bool | None]:
    """Open fds and threads over the steady span: their ranges and fitted growth."""
    fds, threads = s.get("fds_growth"), s.get("threads_growth")
    got = f"{_r(s['fds_range'])} / {_r(s['threads_range'])}"
    if fds is None or threads is None:
        return "open fds / threads", "flat", got, None
    got += f"; fitted growth {fds:+.2f} / {threads:+.2f} over the run"
    flat = abs(fds) < FLAT_GROWTH and abs(threads) < FLAT_GROWTH
    return "open fds / threads", f"flat (growth < {FLAT_GROWTH:g})", got, flat


def _idle_row(idle: dict[str, Any] | None) -> tuple[str, str, str, bool]:
    """KV blocks in use and the KV/expert split after the load stops against before it began
    (bench/soak_idle.py)."""
    name, target = "KV and expert slots when the load stops", "back to idle"
    if idle is None:
        return name, target, "not checked", False
    kv, split = idle["kv_in_use"], idle["memory_split"]
    got = (
        f"KV blocks in use {_fmt(kv[0])} -> {_fmt(kv[1])}, split (KV, experts) "
        f"{_split(split[0])} -> {_split(split[1])} MiB, after {_fmt(idle['waited_s'])} s"
    )
    return name, target, got, idle["back"]


def _split(part: dict[str, float]) -> str:
    return f"{_fmt(part.get('kv', 0) / 2**20)}, {_fmt(part.get('experts', 0) / 2**20)}"


def _kills(raw: dict[str, Any]) -> list[str]:
    out = ["| SIGKILL at (s) | serving again after (s) |", "|---|---|"]
    return out + [f"| {_fmt(k['t'])} | {_fmt(k['restart_s'])} |" for k in raw["kills"]]


def _faults(raw: dict[str, Any]) -> list[str]:
    """The memory-cgroup and full-disk faults (bench/soak_faults.py), one row each."""
    rows = raw.get("faults", [])
    if not rows:
        return ["No memory-cgroup or full-disk fault was injected."]
    out = [
        "| fault | at (s) | lifted after (s) | serving again after (s) | what happened |",
        "|---|---|---|---|---|",
    ]
    for f in rows:
        d = f["detail"]
        if f["kind"] == "memory_cgroup":
            what = (
                f"limit {d['usage_mib']} -> {d['limit_mib']} MiB (usage -> limit); context-filling "
                f"prompts' statuses {d['pressure']}; OOM kills {d['oom_kills']}; front end "
                f"{'survived' if d['front_end_survived'] else '**killed**'}; engine "
                f"{'replaced' if d['engine_replaced'] else 'kept'}"
            )
        else:
            what = (
                f"failed engine starts (ENOSPC) {d['failed_starts']}; server "
                f"{'alive' if d['server_alive'] else '**gone**'}"
            )
        lifted = None if f["lifted"] is None else f["lifted"] - f["t"]
        out.append(
            f"| {f['kind']} | {_fmt(f['t'])} | {_fmt(lifted)} | {_fmt(f['serving_s'])} | {what} |"
        )
    return out


def _per_client_fault(s: dict[str, Any]) -> list[str]:
    """Requests each injected fault cut, per client."""
    faults = sorted(s["per_fault"])
    if not faults:
        return ["No request was cut by an injected fault."]
    out = ["| client | " + " | ".join(faults) + " |", "|---" * (len(faults) + 1) + "|"]
    for client, row in sorted(s.get("per_client_fault", {}).items()):
        out.append(f"| {client} | " + " | ".join(str(row.get(f, 0)) for f in faults) + " |")
    return out


def _read_faults(raw: dict[str, Any]) -> list[str]:
    """The expert read faults the engine injected (--read-faults), by kind, from its log."""
    rf = raw.get("read_faults") or {}
    if not rf.get("spec"):
        return ["", "No expert read faults were injected (no `--read-faults`)."]
    return [
        "",
        f"Expert read faults injected (`--read-faults {rf['spec']}`, slow tier on disk, half the "
        f"experts in the fast tier), by kind, over every engine process: {rf['injected'] or 'none'}. "
        "An `eio` fails the requests that needed the expert (`expert_read_failed`); a `short` "
        "read is read to its end and a `delay` only slows, so neither shows in the outcomes.",
    ]


def page(raw: dict[str, Any], plots: list[str]) -> str:
    s = raw["summary"]
    restarts = ", ".join(_fmt(x) for x in s["restart_s"]) or "none"
    lines = [
        "# Soak: mixed traffic with faults on one server",
        "",
        f"- **Result:** {_fmt(raw['duration_s'] / 60)} min of load on the embedded model (a tiny "
        f"MoE trained here, unless the command names another): {s['requests']} requests "
        f"({_fmt(s['requests_per_second'])}/s), {s['lost']} lost, {s['unexplained_5xx']} "
        f"unexplained 5xx; {s['kills']} engine SIGKILL(s), serving again after {restarts} s; "
        f"front-end RSS slope after warm-up {_fmt(s['rss_slope_mib_per_min'], 2)} MiB/min; "
        f"/health p99 {_fmt(s['health_p99_ms'])} ms (max {_fmt(s['health_max_ms'])} ms); "
        f"SIGTERM drain {_fmt(s['drain_s'])} s, exit code {s['exit_code']}.",
        f"- **Command:** `{raw['command']}`",
        f"- **Machine:** {raw['machine'].removeprefix('Machine: ')}",
        "- **Limit:** the CPUs named above, shared by the server, its engine and every client "
        "thread of the soak (and, on a shared machine, other work): the request rate and the "
        "latencies are bound by them, not by the server's design.",
        "",
        "## Against the acceptance of issue 53",
        "",
        *_acceptance(raw),
        "",
        "## Engine SIGKILLs",
        "",
        *_kills(raw),
        "",
        "## Memory cgroup and full disk",
        "",
        "`--memory-fault-every`: the server's memory cgroup limit drops to the tightest the "
        "kernel accepts (its anonymous memory; cgroup v1 refuses less) for 10 s, while "
        "context-filling prompts arrive. `--disk-full-every`: the quantized-expert cache is "
        "removed, its tmpfs filled and the engine SIGKILLed; its restarts cannot write the cache "
        "for 10 s, or until one has failed on it (at most 60 s). Serving again counts from the "
        "fault's start and holds the supervisor's restart backoff (bench/soak_faults.py).",
        "",
        *_faults(raw),
        "",
        "## Requests per client and outcome",
        "",
        "Outcomes (bench/soak_outcomes.py): `complete` a whole answer; `error` a clear error "
        "object with its status for a cause other than an injected fault (an oversized body's "
        "413, a full queue); `fault` a clear error naming an injected fault "
        "(`engine_restarted`, `engine_restarting` after a SIGKILL, `shutting_down`, `aborted` in "
        "the drain, `expert_read_failed` after an injected EIO); `refused` during the drain, the server never took the request (connection "
        "refused, or a kept-alive connection closed before any byte of a response); "
        "`disconnected` the client left mid-stream on purpose; `lost` anything else. "
        "`schemathesis` counts each exchange of its rounds (bench/soak_generated.py: most are "
        "the 4xx that generated bodies earn); `agent_cli` counts whole Claude Code and Codex CLI "
        "sessions, not their HTTP requests (bench/soak_agents.py).",
        "",
        *_table(s),
        "",
        "Requests cut by each injected fault, per client (a request answered "
        "`engine_restarted` / `engine_restarting` is laid to the fault whose span, from its "
        "start to serving again, holds the request's end; an agent CLI's 5xx likewise):",
        "",
        *_per_client_fault(s),
        "",
        f"Per fault: {s['per_fault'] or 'none'}. Error codes seen (status code): {s['codes']}.",
        *_read_faults(raw),
        *(["", "Lost requests (the first ten):", ""] if s["lost"] else []),
        *(
            f"- {r['client']} {r['kind']} at {_fmt(r['t0'])} s: {r['detail']}"
            for r in s["lost_examples"]
        ),
        *(["", "Unexplained 5xx (the first ten):", ""] if s["unexplained_5xx"] else []),
        *(
            f"- {r['client']} {r['kind']}: {r['status']} {r['code']}"
            for r in s["unexplained_examples"]
        ),
        "",
        "## Over time",
        "",
        f"After the first {int(100 * WARMUP_FRACTION)} % of the run (warm-up) and before the "
        f"SIGTERM: front-end RSS {_r(s['rss_mib_range'])} MiB (slope "
        f"{_fmt(s['rss_slope_mib_per_min'], 2)} MiB/min), open fds {_r(s['fds_range'])}, threads "
        f"{_r(s['threads_range'])}, engine RSS {_r(s['engine_rss_mib_range'])} MiB (a new process "
        f"after each kill), most requests "
        f"waiting {s['waiting_max']}; /health p50 {_fmt(s['health_p50_ms'])} ms, p99 "
        f"{_fmt(s['health_p99_ms'])} ms, unanswered within 5 s: {s['health_unanswered']} "
        f"({s['health_probes']} probes, from a process of its own: bench/soak_health.py).",
        "",
        *(f"![{p}]({p})" for p in plots),
        "",
        *NOT_COVERED,
        "The record is soak.json beside this page: the summary, the kills, the drain and the "
        "samples over time (evenly thinned to at most 300); `--requests-json` also writes every "
        "request's outcome to soak_requests.json.",
    ]
    return "\n".join(lines) + "\n"


def write_page(raw: dict[str, Any], out: Path) -> None:
    try:
        plots = plot(raw, out)
    except ImportError:  # matplotlib is not installed: the page says so instead
        plots = []
    text = page(raw, plots)
    if not plots:
        text = text.replace(
            "## Over time\n", "## Over time\n\n(matplotlib is not installed: no plots.)\n"
        )
    old = out / "soak.md"
    if old.exists() and (at := old.read_text().find(READING)) >= 0:
        text += "\n" + old.read_text()[at:]  # the hand-written reading of the last run survives
    old.write_text(text)
