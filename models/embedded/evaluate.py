"""Evaluate the embedded model pair with plain transformers and write
models/embedded/eval.json and the model card models/embedded/README.md.

Measures: test-split perplexity (per domain and overall) of target and draft, routing statistics
of the MoE target on the test split, the dead-expert check, greedy speculative-decoding acceptance
of the draft at k=4 (simulated: draft proposes k greedy tokens, target verifies greedily), and
three greedy samples.

Measures: ... plus, for the offloading behaviour, per-layer routing entropy, gate quantiles, consecutive-token
overlap, the share of calls each window's most-used 25% of experts serve, and the fetch-all hit rate at cache 0.25
with LRU and with frequency eviction (replayed by engine.offline.simulator).  --compare DIR / --compare-rev REV
measures a second pair (v1) the same way and puts it side by side in the card.

Usage:  python -m models.embedded.evaluate [--threads 1] [--compare-rev 89e4190] [--spec-prompts 24] [--spec-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from models.embedded.evaluation.card import write_card
from models.embedded.evaluation.measure import materialise_rev, measure
from models.embedded.evaluation.text import load_ids, windows
from models.embedded.training.paths import DATA, DRAFT_DIR, HERE, TARGET_DIR


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seq-len", type=int, default=256, help="window length for perplexity / routing stats"
    )
    ap.add_argument("--batch", type=int, default=16, help="windows per forward pass")
    ap.add_argument(
        "--max-windows", type=int, default=0, help="cap windows per domain (0 = whole test split)"
    )
    ap.add_argument(
        "--spec-prompts",
        type=int,
        default=24,
        help="prompts for the speculative-decoding simulation",
    )
    ap.add_argument(
        "--spec-prompt-len",
        type=int,
        default=64,
        help="prompt length (tokens) taken from the test split",
    )
    ap.add_argument("--spec-new-tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--k", type=int, default=4, help="draft tokens proposed per verification")
    ap.add_argument(
        "--cache-fraction",
        type=float,
        default=0.25,
        help="fast-tier size for the fetch-all hit rates",
    )
    ap.add_argument(
        "--cache-tokens",
        type=int,
        default=32768,
        help="test tokens replayed through the cache simulation (half from each domain, in text order)",
    )
    ap.add_argument(
        "--compare",
        default="",
        help="directory with target/ and draft/ of another model pair (e.g. v1) measured the same way "
        "and shown side by side in the card",
    )
    ap.add_argument(
        "--compare-rev",
        default="",
        help="git revision whose models/embedded/{target,draft} are measured as the comparison pair "
        "(written to a temporary directory); e.g. 89e4190 for v1",
    )
    ap.add_argument(
        "--compare-label", default="v1", help="column name of the comparison pair in the card"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads value")
    ap.add_argument(
        "--card-only",
        action="store_true",
        help="rewrite README.md from the stored eval.json and train_log.json without measuring again",
    )
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.card_only:
        card_only()
        return
    from transformers import AutoTokenizer

    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    log = (
        json.load(open(os.path.join(HERE, "train_log.json")))
        if os.path.exists(os.path.join(HERE, "train_log.json"))
        else {}
    )
    wins = {}
    for dom in ("shakespeare", "pydocs"):
        w = windows(load_ids(tok, os.path.join(DATA, f"test_{dom}.txt")), args.seq_len)
        wins[dom] = w[: args.max_windows] if args.max_windows else w
    res, target, draft = measure(TARGET_DIR, DRAFT_DIR, tok, wins, args, log, samples=True)
    res = {"corpus": json.load(open(os.path.join(HERE, "corpus_stats.json"))), **res}
    cmp_dir = args.compare or (materialise_rev(args.compare_rev) if args.compare_rev else "")
    if cmp_dir:
        res["compare"] = measure_comparison(cmp_dir, tok, wins, args)
        if not args.compare:  # the temporary copy made from git
            import shutil

            shutil.rmtree(cmp_dir, ignore_errors=True)
    res["eval_seconds"] = time.time() - t_start
    res["checks"] = checks(res, args)
    json.dump(res, open(os.path.join(HERE, "eval.json"), "w"), indent=2)
    write_card(res, target, draft)
    print(json.dumps(res["checks"], indent=2))


def card_only() -> None:
    """Rewrite README.md from the stored eval.json and train_log.json, measuring nothing."""
    from transformers import AutoModelForCausalLM

    res = json.load(open(os.path.join(HERE, "eval.json")))
    log = json.load(open(os.path.join(HERE, "train_log.json")))
    res["training"].update(
        {
            n: {
                **res["training"][n],
                **{k: log.get(n, {}).get(k) for k in ("phases", "args", "calibration")},
            }
            for n in ("target", "draft")
        }
    )
    write_card(
        res,
        AutoModelForCausalLM.from_pretrained(TARGET_DIR),
        AutoModelForCausalLM.from_pretrained(DRAFT_DIR),
    )


def measure_comparison(cmp_dir: str, tok, wins: dict, args) -> dict:
    """The comparison pair (e.g. v1), measured the same way, with its training log from eval.json."""
    prev = (
        json.load(open(os.path.join(HERE, "eval.json")))
        if os.path.exists(os.path.join(HERE, "eval.json"))
        else {}
    )
    c, _, _ = measure(
        os.path.join(cmp_dir, "target"),
        os.path.join(cmp_dir, "draft"),
        tok,
        wins,
        args,
        (prev.get("compare") or {}).get("log", {}),
        samples=False,
    )
    c["label"] = args.compare_label
    c["source"] = f"git revision {args.compare_rev}" if args.compare_rev else "--compare directory"
    return c


def checks(res: dict, args) -> dict:
    """The card's acceptance checks, each a pass or a fail."""
    spec = res["speculative"]
    ppl = res["perplexity"]
    loc = res["locality"]
    out = {
        "target_ppl_below_draft": ppl["target"]["all"]["ppl"] < ppl["draft"]["all"]["ppl"],
        "target_le_40MB": res["sizes"]["target"]["safetensors_MB"] <= 40.0,
        "draft_le_eighth_active_flops": res["sizes"]["draft_to_target_active_flops"] <= 0.125,
        "no_dead_experts": res["no_dead_experts"]["pass"],
        "fetch_all_lru_hit_rate_ge_0_60": res["cache"]["all"]["fetch_all_hit_rate_lru"] >= 0.60,
        "consecutive_overlap_ge_0_4": loc["consecutive_overlap_mean"] >= 0.4,
        "spec_tokens_per_verification_ge_2_2": spec["pass_ge_2_2_tokens_per_verification"],
    }
    if "compare" in res:
        out["target_ppl_not_worse_than_" + args.compare_label] = (
            ppl["target"]["all"]["ppl"] <= res["compare"]["perplexity"]["target"]["all"]["ppl"]
        )
    return out


if __name__ == "__main__":
    main()
