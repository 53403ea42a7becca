"""Measuring one model pair for the card: sizes, training record, perplexity, routing and cache,
speculative decoding and greedy samples; and the v1 pair materialised from git for comparison."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from models.embedded.evaluation.decoding import generate, greedy_next, speculative
from models.embedded.evaluation.routing import cache_hit_rates, routing_stats
from models.embedded.evaluation.text import load_ids, perplexity
from models.embedded.training.configs import active_params
from models.embedded.training.paths import DATA, ROOT


def file_mb(d):
    return os.path.getsize(os.path.join(d, "model.safetensors")) / 1e6


def materialise_rev(rev: str) -> str:
    """Write the target/ and draft/ of git revision `rev` into a temporary directory (v1's weights
    live only in git history) and return it."""
    import subprocess
    import tempfile

    out = tempfile.mkdtemp(prefix="embedded-" + rev[:12] + "-")
    for sub in ("target", "draft"):
        os.makedirs(os.path.join(out, sub))
        names = subprocess.run(
            ["git", "-C", ROOT, "ls-tree", "--name-only", f"{rev}:models/embedded/{sub}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        for n in names:
            blob = subprocess.run(
                ["git", "-C", ROOT, "show", f"{rev}:models/embedded/{sub}/{n}"],
                check=True,
                capture_output=True,
            ).stdout
            open(os.path.join(out, sub, n), "wb").write(blob)
    return out


def spec_prompts(tok, args) -> list[tuple[str, list[int]]]:
    """64-token test-split prefixes from both domains (seeded) + 2 chat prompts; the same for every model pair."""
    rng = np.random.default_rng(0)
    per_dom = args.spec_prompts // 2
    out = []
    for dom in ("shakespeare", "pydocs"):
        ids = load_ids(tok, os.path.join(DATA, f"test_{dom}.txt"))
        for s in rng.choice(len(ids) - args.spec_prompt_len - 1, size=per_dom, replace=False):
            out.append((dom, ids[s : s + args.spec_prompt_len].tolist()))
    for q in [
        "Continue the scene:\nHAMLET\nTo be, or not to be, that is the question.",
        "Tell me about Python.",
    ]:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, dict) or hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        out.append(("chat", list(prompt)))
    return out


def measure(
    target_dir: str, draft_dir: str, tok, wins: dict, args, log: dict, samples: bool
) -> tuple[dict, object, object]:
    """Every number of the card for one model pair: sizes, perplexity, routing, cache, speculation."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    target.config.output_router_logits = False  # no aux-loss work during plain forwards
    res: dict = {"sizes": sizes(target, draft, target_dir, draft_dir)}
    res["training"] = training_record(log)
    res["perplexity"] = perplexities(target, draft, wins, args.batch, target_dir)
    res.update(routing_and_cache(target, wins, args))
    res["speculative"] = speculation(target, draft, tok, args)
    if samples:
        res["samples"] = greedy_samples(target, tok)
    return res, target, draft


def sizes(target, draft, target_dir: str, draft_dir: str) -> dict:
    ta, da = active_params(target.config), active_params(draft.config)
    out: dict = {
        name: {
            "params": int(sum(p.numel() for p in m.parameters())),
            "architecture": m.config.model_type,
            "safetensors_MB": file_mb(d),
            "dtype": "bfloat16",
            **ap_,
        }
        for name, m, d, ap_ in [("target", target, target_dir, ta), ("draft", draft, draft_dir, da)]
    }
    out["draft_to_target_active_flops"] = da["flops_per_token"] / ta["flops_per_token"]
    return out


TRAINING_KEYS = (
    "steps_done",
    "train_seconds",
    "tokens_per_step",
    "valid",
    "resumed_at_step",
    "seconds_before_resume",
    "seqkd",
    "argv",
    "phase1_argv",
    "phases",
    "args",
    "calibration",
)


def training_record(log: dict) -> dict:
    """What the card reports of each model's training, from the training log."""
    out: dict = {n: {k: log.get(n, {}).get(k) for k in TRAINING_KEYS} for n in ("target", "draft")}
    out["args"] = log.get("args")
    return out


def perplexities(target, draft, wins: dict, batch: int, label: str) -> dict:
    ppl: dict = {}
    for name, m in (("target", target), ("draft", draft)):
        ppl[name] = {}
        tot, n = 0.0, 0
        for dom, w in wins.items():
            r = perplexity(m, w, batch)
            ppl[name][dom] = r
            tot += r["nll"] * r["tokens"]
            n += r["tokens"]
        ppl[name]["all"] = {"nll": tot / n, "ppl": math.exp(tot / n), "tokens": n}
        print(label, name, {d: round(v["ppl"], 2) for d, v in ppl[name].items()}, flush=True)
    return ppl


def routing_and_cache(target, wins: dict, args) -> dict:
    """Routing statistics, the dead-expert check, cache hit rates per domain and locality."""
    res: dict = {}
    allw = wins["shakespeare"] + wins["pydocs"]
    res["routing"], trace = routing_stats(target, allw, args.batch, args.seq_len)
    res["no_dead_experts"] = {
        "criterion": "100% of experts in every layer receive >= 1/4 of the uniform share of routed tokens (test split)",
        "pct_per_layer": [l["experts_ge_quarter_uniform_pct"] for l in res["routing"]],
        "pass": all(l["experts_ge_quarter_uniform_pct"] >= 100.0 for l in res["routing"]),
    }
    n_sh = len(wins["shakespeare"]) * args.seq_len
    half = args.cache_tokens // 2
    cache: dict = {}
    # each domain's text decoded in order from a warm start
    for dom, lo in (("shakespeare", 0), ("pydocs", n_sh)):
        part = {"ids": trace["ids"][lo:], "weights": trace["weights"][lo:], "meta": trace["meta"]}
        cache[dom] = cache_hit_rates(part, args.cache_fraction, half)
    cache["all"] = {
        k: float(np.mean([cache[d][k] for d in ("shakespeare", "pydocs")]))
        for k in ("fetch_all_hit_rate_lru", "fetch_all_hit_rate_frequency")
    }
    cache["all"].update(
        cache_fraction=args.cache_fraction,
        tokens=sum(cache[d]["tokens"] for d in ("shakespeare", "pydocs")),
    )
    res["cache"] = cache
    res["locality"] = {
        "consecutive_overlap_mean": float(
            np.mean([l["repeat_rate_selected_experts"] for l in res["routing"]])
        ),
        "window_top25pct_call_share_mean": float(
            np.mean([l["window_top25pct_experts_call_share"] for l in res["routing"]])
        ),
    }
    print("routing", res["no_dead_experts"], res["locality"], cache["all"], flush=True)
    return res


def speculation(target, draft, tok, args) -> dict:
    """Greedy speculative decoding over the fixed prompts; the first prompt checked against plain greedy."""
    spec_rows = []
    for dom, prompt in spec_prompts(tok, args):
        r = speculative(target, draft, prompt, args.spec_new_tokens, args.k)
        r["domain"] = dom
        r["prompt"] = prompt
        spec_rows.append(r)
    # exactness check: speculative output equals plain target greedy for the first prompt
    first = spec_rows[0]
    plain = list(first["prompt"])
    for _ in range(len(first["ids"])):
        plain.append(greedy_next(target, plain))
    exact = plain[len(first["prompt"]) :] == first["ids"]
    R = sum(r["rounds"] for r in spec_rows)
    spec = {
        "k": args.k,
        "prompts": len(spec_rows),
        "new_tokens_per_prompt": args.spec_new_tokens,
        "verifications": R,
        "mean_accepted_draft_tokens_per_verification": sum(r["accepted"] for r in spec_rows) / R,
        "mean_tokens_per_verification_incl_bonus": sum(r["produced"] for r in spec_rows) / R,
        "first_prompt_matches_plain_target_greedy": exact,
        "per_domain": {},
    }
    for dom in ("shakespeare", "pydocs", "chat"):
        rr = [r for r in spec_rows if r["domain"] == dom]
        Rd = sum(r["rounds"] for r in rr)
        spec["per_domain"][dom] = {
            "verifications": Rd,
            "accepted_per_verification": sum(r["accepted"] for r in rr) / Rd,
            "tokens_per_verification": sum(r["produced"] for r in rr) / Rd,
        }
    spec["pass_ge_2_2_tokens_per_verification"] = (
        spec["mean_tokens_per_verification_incl_bonus"] >= 2.2
    )
    print("spec", {k: v for k, v in spec.items() if k != "per_domain"}, flush=True)
    return spec


def greedy_samples(target, tok) -> list[dict]:
    out = []
    for kind, text in [
        ("shakespeare", "ROMEO\nBut soft, what light through yonder window breaks?\n"),
        ("pydocs", "The json module provides"),
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append({"kind": kind, "prompt": text, "completion": generate(target, tok, ids, 80)})
    msgs = [
        {
            "role": "user",
            "content": "Continue the scene:\nHAMLET\nTo be, or not to be, that is the question.",
        }
    ]
    chat_text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(chat_text, add_special_tokens=False)["input_ids"]
    out.append({"kind": "chat", "prompt": chat_text, "completion": generate(target, tok, ids, 80)})
    return out
