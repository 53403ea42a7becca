"""Evaluate the long-context pair (models/embedded/long) beside the embedded pair it was tuned from,
and write its model card (models/embedded/long/README.md) and numbers (long/eval.json).

    python -m models.embedded.long_eval          # about 3 minutes on 2 cores

Teacher-forced on 4096-token windows of the test split: each model's cross entropy by position
(what the long stage is for), and how often the draft's top-1 token is the target's (the share of
greedy proposals speculative decoding accepts, position by position); on 256-token windows, the
perplexity the main card reports (what the long stage must not cost).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from models.embedded.evaluation.text import load_ids, perplexity, windows
from models.embedded.training.long_context import load_fp32
from models.embedded.training.paths import (
    DATA,
    DRAFT_DIR,
    LONG_DRAFT_DIR,
    LONG_LOG_JSON,
    LONG_TARGET_DIR,
    TARGET_DIR,
)

BUCKETS = ((0, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096))
WINDOW = BUCKETS[-1][1]  # tokens a long window holds, and the context the models are loaded with
PAIRS = {"embedded pair": (TARGET_DIR, DRAFT_DIR), "long pair": (LONG_TARGET_DIR, LONG_DRAFT_DIR)}
CARD = os.path.join(os.path.dirname(LONG_TARGET_DIR), "README.md")


@torch.no_grad()
def by_position(target, draft, wins: list[torch.Tensor]) -> dict[str, list[float]]:
    """Per bucket of BUCKETS: the target's and the draft's mean cross entropy, and the share of
    positions where the draft's top-1 token is the target's."""
    sums = {k: torch.zeros(len(BUCKETS)) for k in ("target_ce", "draft_ce", "agree")}
    for w in wins:
        x, y = w[None, :-1], w[1:]
        lt, ld = target(input_ids=x).logits[0].float(), draft(input_ids=x).logits[0].float()
        per = {
            "target_ce": F.cross_entropy(lt, y, reduction="none"),
            "draft_ce": F.cross_entropy(ld, y, reduction="none"),
            "agree": (lt.argmax(-1) == ld.argmax(-1)).float(),
        }
        for k, v in per.items():
            sums[k] += torch.stack([v[a:b].mean() for a, b in BUCKETS])
    return {k: (v / len(wins)).tolist() for k, v in sums.items()}


def measure(tok, n_long: int, short_every: int) -> dict:
    ids = load_ids(tok, os.path.join(DATA, "test.txt"))
    long_wins = windows(ids, WINDOW)
    long_wins = long_wins[:: max(1, len(long_wins) // n_long)][:n_long]
    short_wins = windows(ids, 256)[::short_every]
    out: dict = {"long_windows": len(long_wins), "short_windows": len(short_wins), "pairs": {}}
    for name, (tdir, ddir) in PAIRS.items():
        target, draft = load_fp32(tdir, WINDOW).eval(), load_fp32(ddir, WINDOW).eval()
        out["pairs"][name] = {
            "by_position": by_position(target, draft, long_wins),
            "ppl_256": {
                "target": perplexity(target, short_wins, 16)["ppl"],
                "draft": perplexity(draft, short_wins, 16)["ppl"],
            },
        }
        print(name, json.dumps(out["pairs"][name]), flush=True)
    return out


def card(res: dict, log: dict) -> str:
    t, d = log["long_target"], log["long_draft"]
    a = log["args"]
    heads = " | ".join(f"{x}-{y}" for x, y in BUCKETS)
    lines = [
        "# The long-context pair (`models/embedded/long`)",
        "",
        "The embedded pair (`models/embedded/target`, `draft`; [its card](../README.md)) trained on 256-token "
        "windows: beyond that its target has seen no distance, and its loss climbs with the position. This pair "
        f"is the same two models fine-tuned on {a['seq_len']}-token windows with the context raised to "
        f"{a['context']} (`max_position_embeddings`): the target for {t['steps_done']} steps "
        f"({a['batch_size']} x {a['seq_len']} tokens, peak learning rate {a['long_target_lr']}, its routing "
        f"balanced as in the last main phase), then the draft for {d['steps_done']} steps distilled from the new "
        f"target (peak {a['long_draft_lr']}). It serves the experiments that need long generations (seed 004's "
        "section 4, [004-spac.md](../../../docs/seeds/004-spac.md)); everything else keeps the embedded pair, "
        "so the pages measured on it stay valid.",
        "",
        "## Rebuild",
        "",
        "```bash",
        ".venv/bin/python -m models.embedded.train " + " ".join(log["args"]["argv"]),
        ".venv/bin/python -m models.embedded.long_eval   # long/eval.json + this card",
        "```",
        "",
        f"Training: target {t['train_seconds'] / 60:.1f} min, draft {d['train_seconds'] / 60:.1f} min on the "
        "project's shared 2-core CPU (other work beside it); curves in `train_log.json` beside this card.",
        "",
        f"## By position (test split, {res['long_windows']} windows of 4096 tokens, teacher-forced)",
        "",
        f"| pair | measure | {heads} |",
        "|---|---|" + "---|" * len(BUCKETS),
    ]
    names = {
        "target_ce": "target cross entropy (nats)",
        "draft_ce": "draft cross entropy (nats)",
        "agree": "draft top-1 = target top-1",
    }
    for pair, r in res["pairs"].items():
        for k, label in names.items():
            vals = r["by_position"][k]
            cells = " | ".join(f"{v:.0%}" if k == "agree" else f"{v:.3f}" for v in vals)
            lines.append(f"| {pair} | {label} | {cells} |")
    lines += [
        "",
        f"## Short windows (test split, {res['short_windows']} windows of 256 tokens, the main card's setting)",
        "",
        "| pair | target perplexity | draft perplexity |",
        "|---|---|---|",
    ]
    for pair, r in res["pairs"].items():
        p = r["ppl_256"]
        lines.append(f"| {pair} | {p['target']:.2f} | {p['draft']:.2f} |")
    lines += [
        "",
        "Same tokenizer, architecture and sizes as the embedded pair (its card's tables apply). All numbers "
        "are produced by `long_eval.py` and stored in `eval.json`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--windows", type=int, default=6, help="4096-token test windows (default 6)")
    ap.add_argument(
        "--short-every", type=int, default=4, help="every Nth 256-token test window (default 4)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    res = measure(AutoTokenizer.from_pretrained(TARGET_DIR), args.windows, args.short_every)
    json.dump(res, open(os.path.join(os.path.dirname(CARD), "eval.json"), "w"), indent=2)
    open(CARD, "w").write(card(res, json.load(open(LONG_LOG_JSON))))
    print(f"wrote {os.path.relpath(CARD)}", flush=True)


if __name__ == "__main__":
    main()
