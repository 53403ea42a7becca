"""Seed 004's MEASURED figures on the embedded pair: MoE-SpAc's configurations and ablations run by
the engine, side by side in interleaved rounds (bench/report.py `interleaved`), one greedy stream
(the seed's setting), decode clock after the first token (bench/spec_bench.py `run_cell`).

Three runs: the main table (cache 0.25 behind the emulated link, every configuration; the same
pair at cache 1.0 in RAM beside llama-server with and without its draft), the cache-ratio sweep,
and long generations. Speculative cells use a fixed k = 4 (so the sensor sees 5-row windows)
unless named "adaptive" (the engine's default rule, which turns speculation off where a window
costs more than it saves)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import interleaved, summarize
from bench.spac_bench import spac_figures
from bench.spec_bench import run_cell
from engine import EngineConfig, SpecConfig, load_model, max_model_len_of

OFF = SpecConfig(speculative="off")
K4 = SpecConfig(speculative="draft", num_speculative_tokens=4, adaptive=False)
ADAPTIVE = SpecConfig(speculative="draft", num_speculative_tokens=4, adaptive=True)
UTILITY = {"prefetch": "utility", "eviction": "utility"}
CPU = {**UTILITY, "cpu_experts": "auto"}
# label -> (speculation, EngineConfig overrides); the simulator's labels (bench/seed004_sim.py) match.
CONFIGS: dict[str, tuple[SpecConfig, dict[str, Any]]] = {
    "plain": (OFF, {"eviction": "lru"}),
    "plain reuse": (OFF, {}),
    "plain+cpu": (OFF, {"cpu_experts": "auto"}),
    "spec adaptive+utility+cpu": (ADAPTIVE, CPU),
    "spec": (K4, {"eviction": "lru"}),
    "spec+utility": (K4, UTILITY),
    "spec+utility prefetch only": (K4, {"prefetch": "utility", "eviction": "lru"}),
    "spec+utility eviction only": (K4, {"eviction": "utility"}),
    "spec+utility+cpu": (K4, CPU),
    "spec+utility+cpu fixed level 2": (K4, {**CPU, "balancer_level": 2}),
    # The utility estimator's ablation: CPU-run experts and speculation, LRU eviction as `spec`'s.
    "spec+cpu, no utility": (K4, {"eviction": "lru", "cpu_experts": "auto"}),
}
RAM_CONFIGS = ("plain", "spec", "spec adaptive+utility+cpu")
SWEEP_CONFIGS = ("plain", "plain reuse", "spec+utility+cpu", "spec adaptive+utility+cpu")
LONG_CONFIGS = ("plain reuse", "spec", "spec+utility+cpu")
SAMPLED_CONFIGS = (
    "plain",
    "plain reuse",
    "spec",
    "spec+cpu, no utility",
    "spec+utility+cpu",
    "spec adaptive+utility+cpu",
)
SEED = 4000  # round r's request is seeded SEED + r in every sampled cell
KEYS = (
    "tok_s",
    "tokens_per_verification",
    "stall_share",
    "hit_rate",
    "precision",
    "recall",
    "bytes_per_token",
    "cpu_calls_per_token",
    "draft_acceptance",
    "drafted",
    "accepted",
)


@dataclass(frozen=True)
class Setting:
    """Where the experts live: the fast tier's share, the slow tier, the emulated link."""

    cache: float
    offload: str = "disk"
    link: str | None = None

    @property
    def name(self) -> str:
        return f"cache {self.cache:g} ({self.offload}{' + ' + self.link if self.link else ''})"


def engine(setting: Setting, label: str, model: str | None = None) -> Any:
    """`label`'s configuration in `setting`, on `model` (default: the embedded target; its draft
    the sibling draft/)."""
    _, over = CONFIGS[label]
    cfg = EngineConfig(
        cache_fraction=setting.cache,
        offload=setting.offload,
        link=setting.link,
        **{"prefetch": "none", **over},
    )
    return load_model(Path(model or _target()), cfg)


def _target() -> str:
    from models import EMBEDDED_TARGET

    return str(EMBEDDED_TARGET)


def engine_figures(
    om: Any,
    label: str,
    prompt: list[int],
    tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> dict[str, Any]:
    r = run_cell(om, CONFIGS[label][0], [prompt], tokens, temperature, seed)
    return {**spac_figures(r), "token_ids": r["token_ids"]}


def measure(
    cells: Sequence[tuple[Any, str]],
    engines: dict[tuple[Any, str], Any],
    prompts: list[list[int]],
    tokens: Callable[[tuple[Any, str]], int],
    rounds: int,
    other: Callable[[tuple[Any, str], list[int], int], dict[str, Any]] | None = None,
) -> dict[tuple[Any, str], list[dict[str, Any]]]:
    """Every cell once per round (after a warm-up round), round r on prompts[r]: engine cells
    through `engines`, the rest (llama-server) through `other`."""
    turn = dict.fromkeys(cells, 0)

    def one(cell: tuple[Any, str]) -> dict[str, Any]:
        prompt = prompts[turn[cell] % len(prompts)]
        turn[cell] += 1
        if cell in engines:
            return engine_figures(engines[cell], cell[1], prompt, tokens(cell))
        assert other is not None
        return other(cell, prompt, tokens(cell))

    return interleaved(cells, rounds, one)


def table(
    res: dict[tuple[Any, str], list[dict[str, Any]]],
    baseline: Callable[[tuple[Any, str]], tuple[Any, str]],
    extra: Callable[[tuple[Any, str]], tuple[Any, str] | None] = lambda c: None,
) -> list[dict[str, Any]]:
    """Medians per cell, its ratio to `baseline(cell)` in the same round, and to `extra(cell)`."""
    rows = []
    for cell, runs in res.items():
        keys = [k for k in KEYS if k in runs[0]]
        row = {"where": cell[0], "config": cell[1], **summarize(res, cell, baseline(cell), keys)}
        if (x := extra(cell)) is not None:
            row["ratio_extra"] = summarize(res, cell, x, [])["ratio"]
        rows.append(row)
    return rows


def close(engines: dict) -> None:
    for om in engines.values():
        om.close()


def _llama_runner(llama: Any) -> Callable[[tuple[Any, str], list[int], int], dict[str, Any]]:
    def run(cell: tuple[Any, str], prompt: list[int], tokens: int) -> dict[str, Any]:
        r = llama.run(cell[1], prompt, tokens)
        r.pop("tokens", None)
        return r

    return run


def main_table(args: Any, prompts: list[list[int]], llama: Any) -> list[dict[str, Any]]:
    """Every configuration at --cache behind --link; the pair at cache 1.0 in RAM beside
    llama-server (when given): ratios to the setting's `plain` and to llama-server -md."""
    link, ram = Setting(args.cache, "disk", args.link), Setting(1.0, "ram")
    engines = {(link.name, c): engine(link, c) for c in CONFIGS}
    engines |= {(ram.name, c): engine(ram, c) for c in RAM_CONFIGS}
    cells = list(engines)
    if llama is not None:
        cells += [(ram.name, c) for c in llama.CELLS]
    try:
        res = measure(
            cells,
            engines,
            prompts,
            lambda c: args.tokens,
            args.rounds,
            _llama_runner(llama) if llama else None,
        )
    finally:
        close(engines)
    peer = (ram.name, "llama-server -md")
    return table(
        res,
        lambda c: (c[0], "plain"),
        lambda c: peer if llama is not None else None,
    )


def sweep_table(args: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """The cache-ratio sweep behind --link: ratios to `plain` at the same cache fraction."""
    settings = {
        Setting(c, "disk", args.link).name: Setting(c, "disk", args.link) for c in args.caches
    }
    engines = {(name, c): engine(s, c) for name, s in settings.items() for c in SWEEP_CONFIGS}
    try:
        res = measure(list(engines), engines, prompts, lambda c: args.sweep_tokens, args.rounds)
    finally:
        close(engines)
    rows = table(res, lambda c: (c[0], "plain"))
    for r in rows:
        r["cache"] = settings[r["where"]].cache
    return rows


def long_runs(args: Any, prompts: list[list[int]], llama: Any) -> list[dict[str, Any]]:
    """Each of --long generation lengths at --cache behind --link (and llama-server -md in RAM):
    ratios to the same configuration at the shortest length, in the same round."""
    context = max_model_len_of(args.long_model, None)
    if args.prompt_tokens + max(args.long) + 5 > context:  # 5: a last k = 4 window
        raise SystemExit(
            f"--long {max(args.long)} tokens after a {args.prompt_tokens}-token prompt do not fit "
            f"{args.long_model}'s {context}-token context: use at most {context - args.prompt_tokens - 5}"
        )
    link = Setting(args.cache, "disk", args.link)
    engines = {(n, c): engine(link, c, args.long_model) for n in args.long for c in LONG_CONFIGS}
    cells = list(engines)
    if llama is not None:
        cells += [(n, "llama-server -md") for n in args.long]
    try:
        res = measure(
            cells,
            engines,
            prompts,
            lambda c: c[0],
            args.long_rounds,
            _llama_runner(llama) if llama else None,
        )
    finally:
        close(engines)
    short = min(args.long)
    rows = table(res, lambda c: (short, c[1]))
    for r in rows:
        r["tokens"] = r.pop("where")
    return rows


def sampled_table(args: Any, texts: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    """SAMPLED_CONFIGS at --cache behind --link, per prompt text: greedy, sampled at --temperature
    seeded (round r's request seeded SEED + r in every configuration, so an exact one generates
    plain's tokens; a proposal is accepted only where it is the token drawn), and sampled unseeded
    (the rejection rule's acceptance, each cell its own text). Ratios to `plain` of the same text
    and decoding, and whether every configuration generated plain's tokens in every round (None
    unseeded)."""
    link = Setting(args.cache, "disk", args.link)
    t = args.temperature
    modes = {
        "greedy": (0.0, False),
        f"T = {t:g}, seeded": (t, True),
        f"T = {t:g}, unseeded": (t, False),
    }
    engines = {((x, m), c): engine(link, c) for x in texts for m in modes for c in SAMPLED_CONFIGS}
    turn = dict.fromkeys(engines, 0)

    def one(cell: tuple[tuple[str, str], str]) -> dict[str, Any]:
        (text, mode), label = cell
        r, turn[cell] = turn[cell], turn[cell] + 1
        prompt = texts[text][r % len(texts[text])]
        temp, seeded = modes[mode]
        return engine_figures(
            engines[cell], label, prompt, args.tokens, temp, SEED + r if seeded else None
        )

    try:
        res = interleaved(list(engines), args.rounds, one)
    finally:
        close(engines)
    rows = table(res, lambda c: (c[0], "plain"))
    for row in rows:
        where = row.pop("where")
        plain, mine = res[(where, "plain")], res[(where, row["config"])]
        same = all(a["token_ids"] == b["token_ids"] for a, b in zip(mine, plain))
        exact = modes[where[1]][1] or not modes[where[1]][0]  # greedy or seeded
        row.update(text=where[0], decoding=where[1], same_tokens_as_plain=same if exact else None)
    return rows
