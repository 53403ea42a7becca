"""Is the default the fastest exact path? `generate`'s defaults against each fixed speculation setting.

On the embedded pair, per cell (cache 1.0 with the RAM tier; cache 0.25 with disk offload), each
setting gets its own loaded model and engine core, built as `moe-offload generate` builds them
(the speculation settings resolved for this machine's device, as the CLI resolves them). After a
warm-up, rounds alternate the settings' order; each round decodes the same greedy prompts with each
setting and compares the tokens. Reports decode tok/s per setting and round, each setting's ratio to
`--speculative off` (median over rounds), whether the tokens are identical, and the steps per path.

Then, served: the defaults at cache 1.0 with `serve`'s batching limits, 1 stream against 8 concurrent
streams (8 prompts submitted at once), aggregate decode tok/s per round (from the first token of the
last request to start until every request ends), and whether each stream's tokens equal its solo run.

    python -m bench.default_path --out docs/benchmarks/default_path.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from engine import (
    CoreLimits,
    EngineConfig,
    EngineCore,
    SamplingParams,
    SpecConfig,
    complete,
    load_model,
    make_speculation,
)
from models import EMBEDDED_TARGET

PROMPTS = (
    "KING HENRY:\nWhat say you to",
    "The history of the city begins",
    "First Citizen:\nBefore we proceed any further,",
    "In the morning the ships",
)
CELLS = {
    "cache 1.0 (ram)": dict(cache_fraction=1.0),
    "cache 0.25 (disk)": dict(cache_fraction=0.25, offload="disk"),
}
SETTINGS = {
    "default": {},
    "--speculative off": dict(speculative="off"),
    "--speculative draft": dict(speculative="draft"),
}


@dataclass
class Setting:
    name: str
    om: Any
    core: EngineCore
    spec: SpecConfig
    why: str


def build(name: str, cell: dict, spec_overrides: dict, max_len: int) -> Setting:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec, why = SpecConfig(**spec_overrides).choose(EMBEDDED_TARGET, device)
    om = load_model(EMBEDDED_TARGET, EngineConfig(**cell))
    proposer, observers = make_speculation(spec, om)
    core = EngineCore.for_model(
        om, CoreLimits(max_running=1, max_model_len=max_len), proposer, observers
    )
    return Setting(name, om, core, spec, why)


def run(s: Setting, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s over the prompts (one request at a time, as `generate` runs) and their tokens."""
    decode_s, n, outs = 0.0, 0, []
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for ids in prompts:
        (c,) = complete(s.core, [s.core.local_request(ids, params)])
        decode_s += c.decode_seconds
        n += len(c.token_ids) - 1
        outs.append(c.token_ids)
    return n / decode_s, outs


def served(args: argparse.Namespace, lines: list[str]) -> None:
    """1 stream against 8, with serve's defaults (CoreLimits' max_running and prefill budget) at cache 1.0."""
    s = build("default", CELLS["cache 1.0 (ram)"], {}, max_len=4096)
    core = EngineCore.for_model(
        s.om,
        CoreLimits(max_model_len=4096),  # serve's max_running and prefill budget
        s.core.proposer,
        tuple(o for o in s.core.observers if o is not s.core.proposer),
    )
    prompts = [list(s.om.tokenizer(p)["input_ids"]) for p in (PROMPTS * 2)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

    def streams(n: int) -> tuple[float, list[list[int]]]:
        done = complete(core, [core.local_request(p, params) for p in prompts[:n]])
        start, end = max(c.t_first or c.t_end for c in done), max(c.t_end for c in done)
        decoded = sum(len(c.token_ids) - 1 for c in done)
        return decoded / (end - start), [c.token_ids for c in done]

    streams(1), streams(8)  # warm-up
    solo = [complete(core, [core.local_request(p, params)])[0].token_ids for p in prompts]
    s.om.stats.reset()
    speeds: dict[int, list[float]] = {1: [], 8: []}
    same = True
    for r in tqdm(range(args.rounds), desc="served", unit="round"):
        for n in (1, 8) if r % 2 == 0 else (8, 1):
            tps, outs = streams(n)
            speeds[n].append(tps)
            same = same and outs == solo[:n]
    ratio = statistics.median(a / b for a, b in zip(speeds[8], speeds[1]))
    steps = s.om.stats.snapshot()["steps"].get("decode", {})
    lines += [
        "## Served: 8 concurrent streams against 1 (defaults, cache 1.0)",
        "",
        "| streams | aggregate decode tok/s per round | × 1 stream (median) | each output = its solo run | decode steps per path |",
        "|---|---|---|---|---|",
        f"| 1 | {' / '.join(f'{v:.1f}' for v in speeds[1])} | 1.00× | yes | |",
        f"| 8 | {' / '.join(f'{v:.1f}' for v in speeds[8])} | {ratio:.2f}× | {'yes' if same else 'NO'} | "
        + ", ".join(f"{p} {n}" for p, n in steps.items())
        + " (both cells) |",
        "",
    ]
    s.om.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--tokens", type=int, default=160, help="greedy tokens per prompt (default 160)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measured rounds, alternating the settings' order (default 3)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, help="write the report (Markdown) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        "# Is the default the fastest exact path?",
        "",
        f"Command: `python -m bench.default_path --tokens {args.tokens} --rounds {args.rounds} --threads {args.threads}`; "
        f"the embedded pair, {len(PROMPTS)} greedy prompts of {args.tokens} tokens, one request at a time, "
        f"{args.threads} thread(s), {time.strftime('%Y-%m-%d')}. Each round runs every setting in turn "
        "(the order alternates between rounds) after one warm-up generate each.",
        "",
    ]
    for cell_name, cell in CELLS.items():
        tok = None
        settings = []
        for name, over in SETTINGS.items():
            s = build(name, cell, over, max_len=4096)
            settings.append(s)
            tok = s.om.tokenizer
        prompts = [list(tok(p)["input_ids"]) for p in PROMPTS]
        for s in settings:
            run(s, prompts[:1], 32)  # warm-up: first-call checks, caches
            s.om.stats.reset()
        speeds: dict[str, list[float]] = {s.name: [] for s in settings}
        outputs: dict[str, list[list[int]]] = {}
        for r in tqdm(range(args.rounds), desc=cell_name, unit="round"):
            for s in settings if r % 2 == 0 else settings[::-1]:
                tps, outs = run(s, prompts, args.tokens)
                speeds[s.name].append(tps)
                outputs.setdefault(s.name, outs)
                assert outputs[s.name] == outs, "greedy output changed between rounds"
        off = speeds["--speculative off"]
        lines += [
            f"## {cell_name}",
            "",
            "| setting | resolves to | tok/s per round | × `--speculative off` (median of rounds) | tokens = off | steps per path |",
            "|---|---|---|---|---|---|",
        ]
        for s in settings:
            ratio = statistics.median(a / b for a, b in zip(speeds[s.name], off))
            same = outputs[s.name] == outputs["--speculative off"]
            steps = s.om.stats.snapshot()["steps"]
            path = "; ".join(
                f"{k}: " + ", ".join(f"{p} {n}" for p, n in v.items()) for k, v in steps.items()
            )
            lines.append(
                f"| {s.name} | {s.spec.speculative} ({s.why}) | {' / '.join(f'{v:.1f}' for v in speeds[s.name])} "
                f"| {ratio:.2f}× | {'yes' if same else 'NO'} | {path} |"
            )
        lines.append("")
        for s in settings:
            s.om.close()
    served(args, lines)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
