"""Plot docs/benchmarks/simulator.json: simulated against measured speed-up (left), and projected
tok/s per hardware profile for each projected shape (right).

    python -m bench.sim_plots --json docs/benchmarks/simulator.json --out docs/benchmarks/simulator.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MARKERS = {
    "policies_speed (teacher-forced)": "o",
    "policies_speed (generate)": "s",
    "spac": "^",
    "speculative": "D",
    "concurrency": "v",
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=Path("docs/benchmarks/simulator.json"),
        help="output of bench.sim_validation --out",
    )
    ap.add_argument(
        "--out", type=Path, default=Path("docs/benchmarks/simulator.png"), help="PNG to write"
    )
    args = ap.parse_args()
    d = json.loads(args.json.read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 6.2))
    rows = d["validation"]
    hi = max(max(r["measured_x"], r["simulated_x"]) for r in rows) * 1.1
    a.fill_between([0, hi], [0, hi * 0.85], [0, hi * 1.15], color="0.9", label="within 15 %")
    a.plot([0, hi], [0, hi], color="0.5", lw=1)
    for table, marker in MARKERS.items():
        pts = [r for r in rows if r["table"] == table]
        if pts:
            a.scatter(
                [r["measured_x"] for r in pts],
                [r["simulated_x"] for r in pts],
                marker=marker,
                s=28,
                label=table,
            )
    a.set_xlabel("measured speed-up (engine, this machine)")
    a.set_ylabel("SIMULATED speed-up")
    a.set_title(f"Simulator vs engine: {d['within_15pct']} of {d['cells']} within 15 %")
    a.set_xlim(0, hi)
    a.set_ylim(0, hi)
    a.legend(fontsize=8, loc="upper left")

    proj = d.get("projections") or []
    configs = [
        "fetch-all",
        "speed-first",
        "spac (exact)"
        if any(p["config"] == "spac (exact)" for p in proj)
        else "spec+utility+cpu (exact)",
    ]
    shapes = sorted({p["shape"] for p in proj})
    profiles = [p for p in dict.fromkeys(p["profile"] for p in proj)]
    width = 0.8 / max(len(configs) * len(shapes), 1)
    for i, (shape, config) in enumerate((s, c) for s in shapes for c in configs):
        vals = [
            next(
                (
                    p["tokens_per_s"]
                    for p in proj
                    if (p["profile"], p["shape"], p["config"]) == (prof, shape, config)
                ),
                0.0,
            )
            for prof in profiles
        ]
        b.bar(
            [j + i * width for j in range(len(profiles))], vals, width, label=f"{shape}: {config}"
        )
    b.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(profiles))], profiles, rotation=20, fontsize=8
    )
    b.set_yscale("log")
    b.set_ylabel("PROJECTED + SIMULATED decode tok/s (cache 0.25, 1 stream)")
    b.set_title("Projected tok/s per hardware profile")
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
