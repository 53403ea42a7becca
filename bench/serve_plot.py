"""The report of `python -m bench serve`: the Markdown table, the JSON-safe rows and the PNG of the
latency-throughput curve (one panel per workload and latency; x: output tok/s reached, one line per
server, a point per arrival rate)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def json_safe(x: Any) -> Any:
    """Rows as strict JSON: infinite rates as "inf", NaN as null."""
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def _ms(x: float) -> str:
    return "–" if math.isnan(x) else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (workload, rate, server)."""
    lines = [
        "| workload | rate (req/s) | server | ok | out tok/s | req/s | goodput (req/s) | "
        "TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) | "
        "out tok per CPU s | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["workload"], r["rate"], r["system"])):
        lat = {
            k: " / ".join(_ms(r[f"p{q}_{k}_ms"]) for q in qs)
            for k, qs in (("ttft", (50, 90, 99)), ("tpot", (50, 90, 99)), ("itl", (50, 99)))
        }
        cpu = r.get("output_tok_per_cpu_s")
        rss = r.get("peak_rss_bytes")
        lines.append(
            f"| {r['workload']} | {rate_label(r['rate'])} | {r['system']} | "
            f"{r['completed']}/{r['requests']} | {r['output_throughput']:.1f} | "
            f"{r['request_throughput']:.2f} | {r['goodput']:.2f} | {lat['ttft']} | {lat['tpot']} | "
            f"{lat['itl']} | {f'{cpu:.0f}' if cpu is not None else '–'} | "
            f"{f'{rss / 2**20:.0f}' if rss else '–'} |"
        )
    return lines


def plot_curves(rows: list[dict[str, Any]], png: Path) -> Path | None:
    """Draw the curves to `png`; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = sorted({r["workload"] for r in rows})
    panels = (("p99_ttft_ms", "TTFT p99 (ms)"), ("p50_tpot_ms", "TPOT p50 (ms)"))
    fig, axes = plt.subplots(
        len(panels), len(workloads), figsize=(5 * len(workloads), 7), squeeze=False
    )
    for j, wl in enumerate(workloads):
        for i, (key, label) in enumerate(panels):
            ax = axes[i][j]
            for system in sorted({r["system"] for r in rows}):
                pts = sorted(
                    (r for r in rows if r["workload"] == wl and r["system"] == system),
                    key=lambda r: r["rate"],
                )
                xs = [r["output_throughput"] for r in pts]
                ax.plot(xs, [r[key] for r in pts], marker="o", label=system)
                for x, r in zip(xs, pts):
                    ax.annotate(rate_label(r["rate"]), (x, r[key]), fontsize=7)
            ax.set_title(f"{wl}: {label} (points: req/s)")
            ax.set_xlabel("output tok/s")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
