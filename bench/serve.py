"""The serving benchmark: latency and throughput of OpenAI-compatible servers under load, as vLLM's
`bench serve` and SGLang's `bench_serving` measure them.

Requests are streaming chat completions (httpx) sent at a list of arrival rates (Poisson or constant; `inf`
sends them all at once). Two workloads (bench/serve_workload.py): `chat`, short distinct prompts, one turn
each; `agent`, N sessions sharing a long system prompt and tool list, several turns each, the history
growing, each session's turns sequential. Per rate it reports TTFT, TPOT and ITL at p50/p90/p99
(bench/serve_stats.py), output tok/s, requests/s, goodput under the SLO (--slo-ttft, --slo-tpot), and for
servers whose pid it knows, the peak RSS of the process tree, its CPU seconds, and the peak of the KV,
cache and expert gauges on /metrics.

Servers: any running one (--base-url, with --server-pid for RSS), or started here: this engine on --model
(the embedded model by default) and, with --llama-server PATH, llama-server `-np N` (prompt cache on) on
the same model's GGUF. Several servers run side by side: every rate runs on each in turn (the order
alternating rate by rate), after a warm-up on each. Writes --out (Markdown), the JSON beside it and a PNG
of the latency-throughput curve (matplotlib).

    python -m bench serve --llama-server LLAMA_CPP/build/bin/llama-server --rates 1,4,inf \\
        --out docs/benchmarks/serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from bench.report import args_payload, machine_line, positive_int, write_report
from bench.serve_belady import belady_lines
from bench.serve_client import (
    RunSpec,
    Target,
    Watcher,
    discover_model,
    run_sessions,
    tree_cpu_seconds,
)
from bench.serve_launch import engine_target, llama_target
from bench.serve_plot import json_safe, plot_curves, table_lines
from bench.serve_stats import summarize
from bench.serve_workload import (
    Session,
    Words,
    agent_workload,
    arrivals,
    chat_workload,
    parse_rates,
    schedule,
)
from engine import portable_path
from models import EMBEDDED_TARGET

WORKLOADS = ("chat", "agent")


def build_sessions(args: argparse.Namespace, workload: str, text_seed: int) -> list[Session]:
    """The workload's sessions: the same text for every server at one rate (the words are seeded),
    other text at each rate and in the warm-up, so no run finds its prompts in a server's cache."""
    words = Words.from_file(args.data, text_seed)
    if workload == "chat":
        return chat_workload(words, args.requests, args.prompt_words)
    return agent_workload(words, args.sessions, args.turns, args.system_words, args.turn_words)


def run_cell(
    args: argparse.Namespace,
    target: Target,
    workload: str,
    rate: float,
    text_seed: int,
    desc: str = "",
) -> dict[str, Any]:
    """One workload at one rate against one server: its summary row."""
    sessions = build_sessions(args, workload, text_seed)
    n = sum(len(s.users) for s in sessions)
    times = schedule(sessions, arrivals(n, rate, args.arrivals, args.seed))
    spec = RunSpec(
        args.output_tokens, ignore_eos=args.ignore_eos, count_logprobs=args.count_logprobs
    )
    cpu0 = tree_cpu_seconds(target.pid) if target.pid else math.nan
    loads0 = target.loads.mark() if target.loads else None
    with (
        tqdm(total=n, desc=desc or f"{target.name} {workload} {rate}", leave=False) as bar,
        Watcher(target) as watch,
    ):
        results, duration = asyncio.run(
            run_sessions(target, sessions, times, spec, lambda: bar.update(1))
        )
    row: dict[str, Any] = {"system": target.name, "workload": workload, "rate": rate}
    row |= summarize(results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    if target.pid:
        cpu = tree_cpu_seconds(target.pid) - cpu0
        row |= {"cpu_s": cpu, "output_tok_per_cpu_s": row["output_tokens"] / max(cpu, 1e-9)}
        row["peak_rss_bytes"] = watch.peak_rss
    row["gauges_peak"] = watch.gauges
    if loads0 is not None:
        row["belady"] = target.loads.compare(
            loads0, target.loads.mark(), row["output_tokens"], duration
        )
    row["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return row


def start_targets(args: argparse.Namespace, stack: ExitStack) -> list[Target]:
    """The servers to measure: those given by URL, then those started here."""
    args.work.mkdir(parents=True, exist_ok=True)
    targets = [
        Target(f"server {i + 1}" if len(args.base_url) > 1 else "server", url, pid=args.server_pid)
        for i, url in enumerate(args.base_url)
    ]
    if not args.base_url or args.engine:
        targets.append(
            stack.enter_context(
                engine_target(
                    args.model,
                    args.engine_args,
                    args.work / "engine.log",
                    args.work / "routes.log" if args.belady else None,
                )
            )
        )
    if args.llama_server:
        targets.append(
            stack.enter_context(
                llama_target(
                    args.llama_server, args.model, args.gguf, args.np, args.threads, args.work
                )
            )
        )
    for t in targets:
        t.model = t.model or discover_model(t.base_url)
    return targets


def measure(args: argparse.Namespace, targets: list[Target]) -> list[dict[str, Any]]:
    """A warm-up on every server, then every rate and workload on each server in turn."""
    for t in targets:
        warm = argparse.Namespace(**{**vars(args), "requests": args.warmup})
        if args.warmup:
            # The warm-up's text seed is one no rate uses (rate i uses seed + i).
            run_cell(
                warm, t, "chat", math.inf, args.seed + len(args.rates), desc=f"warm-up {t.name}"
            )
    rows = []
    for i, rate in enumerate(args.rates):
        order = targets if i % 2 == 0 else targets[::-1]  # alternate who goes first
        for workload in args.workloads:
            for t in order:
                rows.append(run_cell(args, t, workload, rate, args.seed + i))
                r = rows[-1]
                print(
                    f"{t.name:>18} {workload:>5} rate {rate:>4}: {r['completed']}/{r['requests']} ok, "
                    f"{r['output_throughput']:.1f} out tok/s, TTFT p99 {r['p99_ttft_ms']:.0f} ms, "
                    f"TPOT p50 {r['p50_tpot_ms']:.1f} ms",
                    flush=True,
                )
    return rows


def _server_flags(ap: argparse.ArgumentParser) -> None:
    """Which servers: given by URL, or started here."""
    s = ap.add_argument_group("servers")
    s.add_argument(
        "--base-url",
        action="append",
        default=[],
        help="an OpenAI-compatible server already running, e.g. http://127.0.0.1:8000 (repeatable)",
    )
    s.add_argument(
        "--server-pid",
        type=int,
        help="pid of the --base-url server: its process tree's peak RSS and CPU seconds",
    )
    s.add_argument(
        "--engine",
        action="store_true",
        help="also start this engine when --base-url is given (without --base-url it always starts)",
    )
    s.add_argument(
        "--model",
        type=Path,
        default=EMBEDDED_TARGET,
        help="model directory for the servers started here (default: the embedded model)",
    )
    s.add_argument(
        "--engine-args",
        default="",
        help="extra `serve` flags for the engine, one quoted string (e.g. '--cache-fraction 0.25')",
    )
    s.add_argument(
        "--belady",
        action="store_true",
        help="with the engine started here on a partial fast tier (--engine-args '--cache-fraction 0.25 "
        "--offload disk'): log its experts' calls (--route-log) and set its loads beside Belady's MIN "
        "on the same accesses, with the rate MIN's loads would project to (bench/serve_belady.py)",
    )
    s.add_argument("--llama-server", type=Path, help="a llama-server binary: start it beside")
    s.add_argument("--gguf", type=Path, help="GGUF for llama-server (default: convert --model)")
    s.add_argument("--np", type=positive_int, default=8, help="llama-server slots (default 8)")
    s.add_argument("--threads", type=positive_int, default=1, help="llama-server -t (default 1)")
    s.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/serve"),
        help="logs and the GGUF (default .cache/serve)",
    )


def _load_flags(ap: argparse.ArgumentParser) -> None:
    """The workloads, the arrival rates and what each request asks for."""
    w = ap.add_argument_group("load")
    w.add_argument(
        "--workloads",
        default="chat,agent",
        help="comma-separated: chat, agent (default both)",
    )
    w.add_argument(
        "--rates", default="1,4,inf", help="arrival rates in requests/s (default 1,4,inf)"
    )
    w.add_argument(
        "--arrivals",
        choices=("poisson", "constant"),
        default="poisson",
        help="arrival process (default poisson)",
    )
    w.add_argument(
        "--requests", type=positive_int, default=32, help="chat requests per rate (default 32)"
    )
    w.add_argument(
        "--prompt-words", type=positive_int, default=48, help="words per chat prompt (default 48)"
    )
    w.add_argument("--sessions", type=positive_int, default=8, help="agent sessions (default 8)")
    w.add_argument(
        "--turns", type=positive_int, default=3, help="turns per agent session (default 3)"
    )
    w.add_argument(
        "--system-words",
        type=positive_int,
        default=100,
        help="words of the shared agent system prompt, besides the tool list (default 100)",
    )
    w.add_argument(
        "--turn-words", type=positive_int, default=20, help="words per agent turn (default 20)"
    )
    w.add_argument(
        "--output-tokens", type=positive_int, default=32, help="max_tokens per request (default 32)"
    )
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-tokens (default on)",
    )
    w.add_argument(
        "--count-logprobs",
        action="store_true",
        help="ask for logprobs and count each streamed token by its logprobs entry, not its text: for "
        "random-weight checkpoints whose sampled ids decode to no text (bench/real_shapes.py)",
    )
    w.add_argument(
        "--warmup", type=int, default=4, help="chat requests per server before timing (default 4)"
    )
    w.add_argument(
        "--data",
        default="models/embedded/data/test.txt",
        help="text the prompts are cut from (default: the embedded model's test split)",
    )
    w.add_argument(
        "--seed", type=int, default=0, help="seed of the arrivals and the text (default 0)"
    )


def _output_flags(ap: argparse.ArgumentParser) -> None:
    """The SLO of goodput and where the report goes."""
    o = ap.add_argument_group("goodput and output")
    o.add_argument(
        "--slo-ttft",
        dest="slo_ttft_ms",
        type=float,
        default=1000.0,
        help="TTFT SLO for goodput, ms (default 1000)",
    )
    o.add_argument(
        "--slo-tpot",
        dest="slo_tpot_ms",
        type=float,
        default=100.0,
        help="TPOT SLO for goodput, ms (default 100)",
    )
    o.add_argument("--out", type=Path, help="Markdown report; the JSON and the PNG go beside it")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _server_flags(ap)
    _load_flags(ap)
    _output_flags(ap)
    args = ap.parse_args(argv)
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as e:
        ap.error(str(e))
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        ap.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        targets = start_targets(args, stack)
        rows = measure(args, targets)
    header = (
        f"{machine_line(1)} Servers: {', '.join(t.name for t in targets)}; model "
        f"{portable_path(args.model)}. {args.arrivals.capitalize()} arrivals; chat: {args.requests} "
        f"requests of {args.prompt_words} words; agent: {args.sessions} sessions x {args.turns} turns, "
        f"shared system prompt of {args.system_words} words plus 5 tools, {args.turn_words} words a turn; "
        f"{args.output_tokens} output tokens a request; SLO TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= "
        f"{args.slo_tpot_ms:g} ms; one pass per rate, servers alternating, after {args.warmup} warm-up "
        "requests each."
    )
    payload = {"args": args_payload(args), "rows": json_safe(rows)}
    write_report(args.out, header, table_lines(rows) + belady_lines(rows), payload)
    if args.out is not None:
        png = plot_curves(rows, args.out.with_suffix(".png"))
        print(f"curve: {png}" if png else "curve: not drawn (matplotlib is not installed)")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
