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
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
DATA = os.path.join(HERE, "data")
TARGET_DIR = os.path.join(HERE, "target")
DRAFT_DIR = os.path.join(HERE, "draft")
DOC_SEP = "\n<|endoftext|>\n"
EOS_IDS = {0, 4}


def load_ids(tok, path):
    docs = [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d.strip()]
    ids = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(0)
    return np.asarray(ids, dtype=np.int64)


def windows(ids, T):
    n = (len(ids) - 1) // T
    return [torch.from_numpy(ids[i * T : i * T + T + 1]) for i in range(n)]


@torch.no_grad()
def perplexity(model, wins, batch):
    tot, n = 0.0, 0
    for i in range(0, len(wins), batch):
        x = torch.stack(wins[i : i + batch])
        logits = model(input_ids=x[:, :-1]).logits.float()
        tot += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        ).item()
        n += x[:, 1:].numel()
    return {"nll": tot / n, "ppl": math.exp(tot / n), "tokens": n}


GATE_QS = (0.05, 0.25, 0.5, 0.75, 0.95)


def quantiles(x: np.ndarray) -> dict:
    return {f"q{int(q * 100):02d}": float(np.quantile(x, q)) for q in GATE_QS}


@torch.no_grad()
def routing_stats(model, wins, batch, T):
    """Per-layer routing statistics of the target over the given windows.

    Returns (layers, trace): `layers` is a list of per-layer dicts for eval.json; `trace` holds the
    top-k ids and the gate weights the model applies, [N, L, k] in text order, the format of
    engine.offline.trace, so the cache simulation replays exactly what was measured here.
    """
    cfg = model.config
    E, k, L = num_experts(cfg), cfg.num_experts_per_tok, cfg.num_hidden_layers
    routers = RouterTap(model)
    counts = np.zeros((L, E), dtype=np.int64)
    rep_any, rep_top1, n_pairs = np.zeros(L), np.zeros(L), 0
    top1_w, topk_w, topk_mass, tok_ent = ([[] for _ in range(L)] for _ in range(4))
    top1_raw = [[] for _ in range(L)]
    cover = [
        [] for _ in range(L)
    ]  # per window: share of calls that its most-used 25% of experts serve
    ids_all, w_all = [], []
    for i in range(0, len(wins), batch):
        x = torch.stack(wins[i : i + batch])[:, :-1]
        B = x.size(0)
        model(input_ids=x)
        ids_l, w_l = [], []
        for l, (probs, topv, topi, w) in enumerate(routers.take()):
            ids_l.append(topi.view(B, T, k))
            w_l.append(w.view(B, T, k))
            counts[l] += np.bincount(topi.reshape(-1).numpy(), minlength=E)
            top1_w[l].append(w[:, 0].numpy())
            topk_w[l].append(w[:, -1].numpy())
            topk_mass[l].append(topv.sum(-1).numpy())
            top1_raw[l].append(topv[:, 0].numpy())
            tok_ent[l].append(
                (-(probs * probs.clamp_min(1e-12).log()).sum(-1) / math.log(E)).numpy()
            )
            sel = torch.zeros(B * T, E, dtype=torch.bool)
            sel.scatter_(1, topi, True)
            sel = sel.view(B, T, E)
            inter = (sel[:, 1:] & sel[:, :-1]).sum(
                -1
            ).float() / k  # share of experts reused from previous token
            rep_any[l] += inter.sum().item()
            t1 = topi.view(B, T, k)[:, :, 0]
            rep_top1[l] += (t1[:, 1:] == t1[:, :-1]).float().sum().item()
            per_win = sel.sum(1).float()  # (B, E) calls per expert in each window
            top = torch.topk(per_win, E // 4, dim=-1).values.sum(-1)
            cover[l].append((top / (T * k)).numpy())
        n_pairs += B * (T - 1)
        ids_all.append(torch.stack(ids_l, dim=2).reshape(B * T, L, k))
        w_all.append(torch.stack(w_l, dim=2).reshape(B * T, L, k))
    layers = []
    for l in range(L):
        share = counts[l] / counts[l].sum()
        ent = float(-(share[share > 0] * np.log(share[share > 0])).sum())
        w = np.concatenate(top1_w[l])
        wk = np.concatenate(topk_w[l])
        alive = share >= 0.25 / E
        layers.append(
            {
                "layer": l,
                "routed_assignments": int(counts[l].sum()),
                "usage_entropy_nats": ent,
                "usage_entropy_normalized": ent / math.log(E),
                "token_router_entropy_normalized_mean": float(np.concatenate(tok_ent[l]).mean()),
                "experts_never_routed_share": float((counts[l] == 0).mean()),
                "experts_ge_quarter_uniform_pct": float(100 * alive.mean()),
                "min_expert_share_vs_uniform": float(share.min() * E),
                "max_expert_share_vs_uniform": float(share.max() * E),
                "repeat_rate_selected_experts": float(rep_any[l] / n_pairs),
                "repeat_rate_top1_expert": float(rep_top1[l] / n_pairs),
                "random_baseline_repeat_rate": k / E,
                "window_top25pct_experts_call_share": float(np.concatenate(cover[l]).mean()),
                "top1_gate_weight_normalized_quantiles": quantiles(w),
                "topk_last_gate_weight_normalized_quantiles": quantiles(wk),
                "topk_router_mass_quantiles": quantiles(np.concatenate(topk_mass[l])),
                "top1_router_prob_quantiles": quantiles(np.concatenate(top1_raw[l])),
            }
        )
    routers.close()
    ids_t = torch.cat(ids_all).numpy()
    w_t = torch.cat(w_all).numpy()
    for l in range(
        L
    ):  # share of calls whose gate passes the 0.15 rule (fetched on a miss by Quality-First)
        layers[l]["calls_with_gate_ge_0_15_share"] = float((w_t[:, l, :] >= 0.15).mean())
    return layers, {
        "ids": ids_t.astype(np.int16),
        "weights": w_t.astype(np.float32),
        "meta": {"num_experts": E, "top_k": k},
    }


def num_experts(cfg) -> int:
    return getattr(cfg, "n_routed_experts", None) or cfg.num_experts


class RouterTap:
    """Reads each MoE layer's routing from its router module: what the model itself chose and applied.

    Every transformers 5 router here returns (logits, applied top-k weights, top-k ids). `take()` gives
    per layer: the router's distribution over experts (softmax of the logits; for sigmoid routers
    with a balancing bias (glm4_moe) the sigmoid scores normalised to sum 1), that distribution at the
    chosen experts, the chosen ids and the applied weights, each ordered by applied weight, largest first.
    """

    def __init__(self, model) -> None:
        from engine.weights.moe_hook import router_name

        self.records: list = []
        self.sigmoid, self.handles = [], []
        for layer in model.model.layers:
            router = getattr(layer.mlp, router_name(layer.mlp))
            self.sigmoid.append(hasattr(router, "e_score_correction_bias"))
            self.handles.append(
                router.register_forward_hook(lambda mod, inp, out: self.records.append(out))
            )

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = []
        for sig, (logits, w, ids) in zip(self.sigmoid, self.records):
            if sig:
                s = torch.sigmoid(logits.float())
                probs = s / s.sum(-1, keepdim=True)
            else:
                probs = F.softmax(logits.float(), dim=-1)
            w, order = w.float().sort(-1, descending=True)
            ids = ids.gather(1, order)
            out.append((probs, probs.gather(1, ids), ids, w))
        self.records = []
        return out


def cache_hit_rates(trace: dict, fraction: float, tokens: int) -> dict:
    """Fetch-all hit rate at a fast tier of `fraction` of all experts, replayed by the project's
    router-trace simulator (engine.offline.simulator: one slot pool over all layers, the current
    layer's experts pinned, the engine's round-robin warm start) with the engine's own eviction
    objects.  Only residency matters for the hit rate; the hardware profile is a placeholder."""
    from engine.offline.hardware import costs_for
    from engine.offline.simulator import SimSettings, Simulator
    from policies.registry import make_policies

    costs = costs_for("this-machine-disk", "embedded")  # only residency matters for the hit rate
    sub = {
        "ids": trace["ids"][:tokens],
        "weights": trace["weights"][:tokens],
        "meta": trace["meta"],
    }
    out = {"cache_fraction": fraction, "tokens": int(len(sub["ids"]))}
    for ev in ("lru", "frequency"):
        r = Simulator(
            sub,
            make_policies("fetch-all", eviction=ev),
            costs,
            SimSettings(cache_fraction=fraction),
        ).run()
        out[f"fetch_all_hit_rate_{ev}"] = r.calls_hit / r.calls
    return out


@torch.no_grad()
def greedy_next(model, ids):
    return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())


@torch.no_grad()
def speculative(target, draft, prompt, new_tokens, k):
    """Greedy speculative decoding without KV cache (exactness > speed here)."""
    ids = list(prompt)
    rounds, accepted_total, produced = 0, 0, 0
    while produced < new_tokens:
        prop = []
        cur = list(ids)
        for _ in range(k):
            t = greedy_next(draft, cur)
            prop.append(t)
            cur.append(t)
        logits = target(input_ids=torch.tensor([ids + prop])).logits[0]
        tgt = logits[len(ids) - 1 :].argmax(-1).tolist()  # k+1 target greedy tokens
        a = 0
        while a < k and prop[a] == tgt[a]:
            a += 1
        new = prop[:a] + [tgt[a]]
        rounds += 1
        accepted_total += a
        produced += len(new)
        ids += new
        if any(t in EOS_IDS for t in new):
            break
    return {
        "rounds": rounds,
        "accepted": accepted_total,
        "produced": produced,
        "ids": ids[len(prompt) :],
    }


@torch.no_grad()
def generate(model, tok, ids, n):
    out = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
    )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=False)


def file_mb(d):
    return os.path.getsize(os.path.join(d, "model.safetensors")) / 1e6


def fmt(x, nd=3):
    return f"{x:.{nd}f}"


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

    from models.embedded.train import active_params

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    target.config.output_router_logits = False  # no aux-loss work during plain forwards
    res: dict = {}
    ta, da = active_params(target.config), active_params(draft.config)
    res["sizes"] = {
        name: {
            "params": int(sum(p.numel() for p in m.parameters())),
            "architecture": m.config.model_type,
            "safetensors_MB": file_mb(d),
            "dtype": "bfloat16",
            **ap_,
        }
        for name, m, d, ap_ in [("target", target, target_dir, ta), ("draft", draft, draft_dir, da)]
    }
    res["sizes"]["draft_to_target_active_flops"] = da["flops_per_token"] / ta["flops_per_token"]
    res["training"] = {
        n: {
            k: log.get(n, {}).get(k)
            for k in (
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
        }
        for n in ("target", "draft")
    }
    res["training"]["args"] = log.get("args")

    # ---- perplexity
    ppl = {}
    for name, m in (("target", target), ("draft", draft)):
        ppl[name] = {}
        tot, n = 0.0, 0
        for dom, w in wins.items():
            r = perplexity(m, w, args.batch)
            ppl[name][dom] = r
            tot += r["nll"] * r["tokens"]
            n += r["tokens"]
        ppl[name]["all"] = {"nll": tot / n, "ppl": math.exp(tot / n), "tokens": n}
        print(target_dir, name, {d: round(v["ppl"], 2) for d, v in ppl[name].items()}, flush=True)
    res["perplexity"] = ppl

    # ---- routing + cache
    allw = wins["shakespeare"] + wins["pydocs"]
    res["routing"], trace = routing_stats(target, allw, args.batch, args.seq_len)
    res["no_dead_experts"] = {
        "criterion": "100% of experts in every layer receive >= 1/4 of the uniform share of routed tokens (test split)",
        "pct_per_layer": [l["experts_ge_quarter_uniform_pct"] for l in res["routing"]],
        "pass": all(l["experts_ge_quarter_uniform_pct"] >= 100.0 for l in res["routing"]),
    }
    n_sh = len(wins["shakespeare"]) * args.seq_len
    half = args.cache_tokens // 2
    cache = {}
    for dom, lo in (
        ("shakespeare", 0),
        ("pydocs", n_sh),
    ):  # each domain's text decoded in order from a warm start
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

    # ---- speculative decoding
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
    res["speculative"] = spec
    print("spec", {k: v for k, v in spec.items() if k != "per_domain"}, flush=True)

    if samples:
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
        out.append(
            {"kind": "chat", "prompt": chat_text, "completion": generate(target, tok, ids, 80)}
        )
        res["samples"] = out
    return res, target, draft


def main(argv=None):
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
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.card_only:
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
        return

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
        c["source"] = (
            f"git revision {args.compare_rev}" if args.compare_rev else "--compare directory"
        )
        res["compare"] = c
        if not args.compare:  # the temporary copy made from git
            import shutil

            shutil.rmtree(cmp_dir, ignore_errors=True)
    res["eval_seconds"] = time.time() - t_start
    spec = res["speculative"]
    ppl = res["perplexity"]
    loc = res["locality"]
    checks = {
        "target_ppl_below_draft": ppl["target"]["all"]["ppl"] < ppl["draft"]["all"]["ppl"],
        "target_le_40MB": res["sizes"]["target"]["safetensors_MB"] <= 40.0,
        "draft_le_eighth_active_flops": res["sizes"]["draft_to_target_active_flops"] <= 0.125,
        "no_dead_experts": res["no_dead_experts"]["pass"],
        "fetch_all_lru_hit_rate_ge_0_60": res["cache"]["all"]["fetch_all_hit_rate_lru"] >= 0.60,
        "consecutive_overlap_ge_0_4": loc["consecutive_overlap_mean"] >= 0.4,
        "spec_tokens_per_verification_ge_2_2": spec["pass_ge_2_2_tokens_per_verification"],
    }
    if "compare" in res:
        checks["target_ppl_not_worse_than_" + args.compare_label] = (
            ppl["target"]["all"]["ppl"] <= res["compare"]["perplexity"]["target"]["all"]["ppl"]
        )
    res["checks"] = checks
    json.dump(res, open(os.path.join(HERE, "eval.json"), "w"), indent=2)
    write_card(res, target, draft)
    print(json.dumps(checks, indent=2))


def _shared_intermediate(cfg) -> int:
    if getattr(
        cfg, "n_shared_experts", None
    ):  # glm4_moe: n_shared_experts x moe_intermediate_size, no gate
        return cfg.n_shared_experts * cfg.moe_intermediate_size
    return getattr(cfg, "shared_expert_intermediate_size", 0) or 0


def _mlp_desc(cfg) -> str:
    shared = _shared_intermediate(cfg)
    gated = "sigmoid-gated" if hasattr(cfg, "shared_expert_intermediate_size") else "ungated"
    router = (
        "sigmoid router, top-k on score + balancing bias"
        if getattr(cfg, "n_routed_experts", None)
        else "softmax router"
    )
    return (
        f"{num_experts(cfg)} routed experts per layer (every layer sparse), top-{cfg.num_experts_per_tok}, "
        f"moe_intermediate_size {cfg.moe_intermediate_size}, {router}"
        + (
            f", 1 shared expert (intermediate {shared}, {gated})"
            if shared
            else ", no shared expert"
        )
        + (", norm_topk_prob" if cfg.norm_topk_prob else "")
    )


def _flops_line(name: str, cfg, x: dict) -> str:
    if hasattr(cfg, "num_experts") or getattr(cfg, "n_routed_experts", None):
        shared = _shared_intermediate(cfg)
        gate = (
            f" + shared gate {cfg.hidden_size}"
            if hasattr(cfg, "shared_expert_intermediate_size")
            else ""
        )
        mlp = (
            f"MLP = top-{cfg.num_experts_per_tok} × 3 × {cfg.hidden_size} × {cfg.moe_intermediate_size} + router "
            f"{cfg.hidden_size} × {num_experts(cfg)}"
            + (f" + shared expert 3 × {cfg.hidden_size} × {shared}{gate}" if shared else "")
            + f" = {x['mlp_per_layer']:,}"
        )
    else:
        mlp = f"MLP = 3 × {cfg.hidden_size} × {cfg.intermediate_size} = {x['mlp_per_layer']:,}"
    return (
        f"* {name}: per layer attention q/k/v/o = {x['attention_per_layer']:,}, {mlp}; × {cfg.num_hidden_layers} "
        f"layers + lm_head {cfg.hidden_size} × {cfg.vocab_size} = {x['lm_head']:,} → {x['active_params']:,} active "
        f"params → **{x['flops_per_token']:,} FLOPs/token**"
    )


def _q(d: dict) -> str:
    return " / ".join(f"{d[k]:.3f}" for k in ("q05", "q25", "q50", "q75", "q95"))


def comparison_table(res: dict) -> list[str]:
    """v1 and v2 side by side: the statistics that decide offloading behaviour."""
    c = res["compare"]
    lab = c["label"]
    pairs = [(lab, c), ("v2 (this)", res)]
    L = [f"| | {pairs[0][0]} | {pairs[1][0]} |", "|---|---|---|"]

    def row(title, fn):
        L.append(f"| {title} | " + " | ".join(fn(r) for _, r in pairs) + " |")

    row(
        "architecture",
        lambda r: (
            f"`{r['sizes']['target']['architecture']}` / `{r['sizes']['draft']['architecture']}`"
        ),
    )
    row(
        "target model.safetensors (bf16)",
        lambda r: f"{r['sizes']['target']['safetensors_MB']:.2f} MB",
    )
    row("target active FLOPs/token", lambda r: f"{r['sizes']['target']['flops_per_token']:,}")
    row(
        "draft active FLOPs/token (÷ target)",
        lambda r: (
            f"{r['sizes']['draft']['flops_per_token']:,} "
            f"({r['sizes']['draft_to_target_active_flops']:.4f})"
        ),
    )
    row(
        "target PPL (test, all / shakespeare / pydocs)",
        lambda r: " / ".join(
            f"{r['perplexity']['target'][d]['ppl']:.2f}" for d in ("all", "shakespeare", "pydocs")
        ),
    )
    row("draft PPL (test, all)", lambda r: f"{r['perplexity']['draft']['all']['ppl']:.2f}")
    row(
        "tokens / verification at k=4 (all)",
        lambda r: f"{r['speculative']['mean_tokens_per_verification_incl_bonus']:.3f}",
    )
    row(
        "experts ≥ ¼ uniform share, worst layer",
        lambda r: f"{min(l['experts_ge_quarter_uniform_pct'] for l in r['routing']):.1f}%",
    )
    row(
        "usage entropy ÷ max, per layer",
        lambda r: " / ".join(f"{l['usage_entropy_normalized']:.3f}" for l in r["routing"]),
    )
    row(
        "per-token router entropy ÷ max, per layer",
        lambda r: " / ".join(
            f"{l['token_router_entropy_normalized_mean']:.3f}" for l in r["routing"]
        ),
    )
    row(
        "consecutive-token overlap of selected experts, per layer (mean)",
        lambda r: (
            " / ".join(f"{l['repeat_rate_selected_experts']:.3f}" for l in r["routing"])
            + f" (**{r['locality']['consecutive_overlap_mean']:.3f}**)"
        ),
    )
    row(
        "random-routing overlap k/E",
        lambda r: f"{r['routing'][0]['random_baseline_repeat_rate']:.4f}",
    )
    row(
        "calls served by each window's most-used 25% of experts, per layer (mean)",
        lambda r: (
            " / ".join(f"{l['window_top25pct_experts_call_share']:.3f}" for l in r["routing"])
            + f" (**{r['locality']['window_top25pct_call_share_mean']:.3f}**)"
        ),
    )
    row(
        "fetch-all hit rate, cache 0.25, LRU (shakespeare / pydocs)",
        lambda r: (
            f"**{r['cache']['all']['fetch_all_hit_rate_lru']:.3f}** ({r['cache']['shakespeare']['fetch_all_hit_rate_lru']:.3f} / "
            f"{r['cache']['pydocs']['fetch_all_hit_rate_lru']:.3f})"
        ),
    )
    row(
        "fetch-all hit rate, cache 0.25, frequency (shakespeare / pydocs)",
        lambda r: (
            f"**{r['cache']['all']['fetch_all_hit_rate_frequency']:.3f}** ({r['cache']['shakespeare']['fetch_all_hit_rate_frequency']:.3f} / "
            f"{r['cache']['pydocs']['fetch_all_hit_rate_frequency']:.3f})"
        ),
    )
    row(
        "top-1 gate (normalised) median, per layer",
        lambda r: " / ".join(
            f"{l['top1_gate_weight_normalized_quantiles']['q50']:.3f}" for l in r["routing"]
        ),
    )
    row(
        "k-th gate (normalised) median, per layer",
        lambda r: " / ".join(
            f"{l['topk_last_gate_weight_normalized_quantiles']['q50']:.3f}" for l in r["routing"]
        ),
    )
    row(
        "router mass of the top-k median, per layer",
        lambda r: " / ".join(f"{l['topk_router_mass_quantiles']['q50']:.3f}" for l in r["routing"]),
    )
    row(
        "calls with gate ≥ 0.15 (fetched by the 0.15 rule), per layer",
        lambda r: " / ".join(f"{l['calls_with_gate_ge_0_15_share']:.3f}" for l in r["routing"]),
    )
    return L


def routing_table(r: list[dict]) -> list[str]:
    L = [
        "| layer | usage entropy ÷ max | token router entropy ÷ max | ≥¼ uniform share | min / max share ÷ uniform | "
        "overlap (selected) | overlap (top-1) | window top-25% call share | gate ≥ 0.15 | "
        "top-1 gate q05 / q25 / q50 / q75 / q95 | k-th gate q05 / q25 / q50 / q75 / q95 | top-k router mass q05 / q25 / q50 / q75 / q95 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for l in r:
        L.append(
            f"| {l['layer']} | {l['usage_entropy_normalized']:.3f} | {l['token_router_entropy_normalized_mean']:.3f} | "
            f"{l['experts_ge_quarter_uniform_pct']:.1f}% | "
            f"{l['min_expert_share_vs_uniform']:.2f} / {l['max_expert_share_vs_uniform']:.2f} | "
            f"{l['repeat_rate_selected_experts']:.3f} | {l['repeat_rate_top1_expert']:.3f} | "
            f"{l['window_top25pct_experts_call_share']:.3f} | {l['calls_with_gate_ge_0_15_share']:.3f} | "
            f"{_q(l['top1_gate_weight_normalized_quantiles'])} | {_q(l['topk_last_gate_weight_normalized_quantiles'])} | "
            f"{_q(l['topk_router_mass_quantiles'])} |"
        )
    return L


def write_card(res, target, draft):
    c, s, p, r = res["corpus"], res["sizes"], res["perplexity"], res["routing"]
    tr = res["training"]
    tc, dc = target.config, draft.config
    a = tr.get("args") or {}

    def mins(x):
        return f"{x / 60:.1f} min" if x else "n/a"

    L = []
    L.append("# Embedded default model pair (`models/embedded`)\n")
    L.append(
        f"A tiny MoE **target** (`{tc.model_type}`: fine-grained routed experts plus a shared expert, like "
        "DeepSeek-V3, GLM-4.5 and Qwen3-Next) and a dense Qwen3 **draft** trained from scratch on CPU on two "
        "public-domain/permissively licensed text domains, shipped as the project's default model pair for "
        "offloading and speculative-decoding tests. They are toy-quality language models: they write "
        "Shakespeare-like verse and Python-documentation-like prose, not correct answers. This is **v2**; v1 "
        "(64-expert `qwen3_moe` without a shared expert, near-uniform routing) is in git history "
        "(revision `89e4190`) and measured beside v2 below.\n"
    )
    L.append("## Files\n")
    L.append(
        "* `target/`, `draft/`: `config.json`, `model.safetensors` (bf16), `generation_config.json`, `tokenizer.json`, "
        "`tokenizer_config.json`, `chat_template.jinja` (the same tokenizer in both)\n"
        "* `data/`: `valid.txt`, `test.txt` and per-domain `valid_*.txt`, `test_*.txt` (documents separated by "
        "`\\n<|endoftext|>\\n`)\n"
        "* `corpus_stats.json`, `train_log.json`, `eval.json`; scripts `build_corpus.py`, `train.py`, `evaluate.py`\n"
    )
    L.append("## Rebuild\n")
    cmds = [
        ".venv/bin/python -m models.embedded.build_corpus   # corpus splits + BPE tokenizer (deterministic)"
    ]
    for argv in (tr["target"].get("phases") or [tr["target"].get("phase1_argv")]) + [
        tr["target"].get("argv")
    ]:
        if argv:
            cmds.append(".venv/bin/python -m models.embedded.train " + " ".join(argv))
    if tr["draft"].get("argv"):
        cmds.append(".venv/bin/python -m models.embedded.train " + " ".join(tr["draft"]["argv"]))
    cmds.append(
        ".venv/bin/python -m models.embedded.evaluate --threads 1 --compare-rev 89e4190   # eval.json + this README"
    )
    L.append("```bash\n" + "\n".join(cmds) + "\n```\n")
    if a:
        L.append(
            f"The recorded runs used seq {a.get('seq_len')}, batch {a.get('batch_size')}, seed {a.get('seed')}, "
            f"{a.get('threads')} thread(s) and fixed step counts, so a seeded rerun is step-exact "
            "(`train_log.json` keeps the arguments of the last stage run).\n"
        )
    L.append("## Corpus\n")
    L.append(
        f"* **shakespeare**: {c['source']['shakespeare']}; markdown stripped (bold speaker names, headings, "
        "italic stage directions).\n"
    )
    L.append(
        "* **pydocs**: Python 3.11 documentation sources (Debian package `python3.11-doc`, `html/_sources`: "
        "tutorial, library, howto, reference, faq, using, extending, glossary); reST roles, "
        "directives and heading underlines removed; capped to the size of the Shakespeare domain.\n"
    )
    L.append(
        f"* Splits are by whole document (play / doc page), seeded (seed {c['seed']}); the documents of each "
        "split are listed in `corpus_stats.json`. `data/` ships `valid*.txt` and `test*.txt`; `train.txt` is "
        "rebuilt by `build_corpus.py` (git-ignored).\n"
    )
    L.append(
        "| domain | train bytes | valid bytes | test bytes | docs train/valid/test |\n|---|---|---|---|---|"
    )
    for d in ("shakespeare", "pydocs"):
        b, n = c["bytes"][d], c["documents"][d]
        L.append(
            f"| {d} | {b['train']:,} | {b['valid']:,} | {b['test']:,} | {n['train']}/{n['valid']}/{n['test']} |"
        )
    b = c["bytes"]["total"]
    L.append(f"| total | {b['train']:,} | {b['valid']:,} | {b['test']:,} | |\n")
    L.append(
        "About 5% of training rows are synthetic single-turn chats "
        "(`<|im_start|>user\\nContinue the scene:\\n<passage><|im_end|>\\n<|im_start|>assistant\\n<next passage><|im_end|>`), "
        "so a chat-formatted prompt produces text and ends with `<|im_end|>`.\n"
    )
    L.append("## Tokenizer\n")
    L.append(
        "Byte-level BPE, vocab 8192, trained with `tokenizers` on the train split. Special tokens: "
        "`<|endoftext|>`=0 (eos, document separator), `<|bos|>`=1, `<|pad|>`=2, `<|im_start|>`=3, `<|im_end|>`=4. "
        "No token is added automatically. ChatML chat template (`<|im_start|>{role}\\n{content}<|im_end|>\\n`, "
        "`add_generation_prompt` appends `<|im_start|>assistant\\n`). `generation_config.json` stops on "
        "`eos_token_id=[0, 4]`.\n"
    )
    L.append("## Models\n")
    L.append("| | target | draft |\n|---|---|---|")
    L.append(f"| architecture | `{type(target).__name__}` | `{type(draft).__name__}` (dense) |")
    L.append(
        f"| layers / hidden | {tc.num_hidden_layers} / {tc.hidden_size} | {dc.num_hidden_layers} / {dc.hidden_size} |"
    )
    L.append(
        f"| heads / kv heads / head_dim | {tc.num_attention_heads} / {tc.num_key_value_heads} / {getattr(tc, 'head_dim', tc.hidden_size // tc.num_attention_heads)} | "
        f"{dc.num_attention_heads} / {dc.num_key_value_heads} / {dc.head_dim} |"
    )
    L.append(f"| MLP | {_mlp_desc(tc)} | dense SwiGLU, intermediate {dc.intermediate_size} |")
    L.append(
        f"| vocab / tied embeddings / max positions | {tc.vocab_size} / yes / {tc.max_position_embeddings} | "
        f"{dc.vocab_size} / yes / {dc.max_position_embeddings} |"
    )
    L.append(f"| parameters | {s['target']['params']:,} | {s['draft']['params']:,} |")
    L.append(
        f"| model.safetensors (bf16) | {s['target']['safetensors_MB']:.2f} MB | {s['draft']['safetensors_MB']:.2f} MB |"
    )
    L.append(
        f"| active params / token (matmuls) | {s['target']['active_params']:,} | {s['draft']['active_params']:,} |"
    )
    L.append(
        f"| training | {tr['target'].get('steps_done')} steps, {mins(tr['target'].get('train_seconds'))} | "
        f"{tr['draft'].get('steps_done')} steps, {mins(tr['draft'].get('train_seconds'))}"
        + (
            f" + {mins((tr['draft'].get('seqkd') or {}).get('seconds'))} generating seq-KD data"
            if tr["draft"].get("seqkd")
            else ""
        )
        + " |"
    )
    ta = tr["target"].get(
        "args"
    )  # the target stage's own settings (the log's top-level args are the last stage's)
    if not ta and tr["target"].get("argv"):
        from models.embedded.train import build_parser

        ta = vars(build_parser().parse_args(tr["target"]["argv"]))
    ta = ta or a
    bal = "bias" if ta.get("arch") == "glm4_moe" else a.get("balance", "micro")
    if bal == "bias":
        aux_txt = (
            f"CE + consecutive-token locality term (controller target overlap {ta.get('sticky_target')}, "
            f"coefficient ≤ {ta.get('sticky_cap')}); balance by DeepSeek-V3's auxiliary-loss-free bias "
            f"(updated from the counts of each step's {ta.get('batch_size')} sequences), no balance loss; "
            "see below"
        )
    elif bal == "global":
        aux_txt = (
            f"CE + global-batch load balancing (counts over {ta.get('balance_window')} steps × "
            f"{ta.get('batch_size')} sequences, coefficient ≥ {ta.get('aux_coef')}, guarded) + consecutive-token "
            f"locality term (controller target overlap {ta.get('sticky_target')}); see below"
        )
    else:
        aux_txt = (
            f"CE + {tc.router_aux_loss_coef} × per-micro-batch load-balancing aux loss ({bal})"
        )
    sk = tr["draft"].get("seqkd")
    draft_loss = (
        f"{1 - (ta.get('distill_alpha') or 0):.1f} × CE + {ta.get('distill_alpha')} × KL(target ‖ draft) "
        "distillation"
        + (
            f"; {100 * sk['frac']:.0f}% of rows are target greedy continuations "
            f"(sequence-level KD, {sk['sequences']} rows)"
            if sk
            else ""
        )
    )
    L.append(f"| loss | {aux_txt} | {draft_loss} |\n")
    L.append(
        "Training: AdamW (β=0.9/0.95, wd 0.05 on matrices), linear warm-up then cosine to 10% of peak, grad clip 1, "
        f"batch {ta.get('batch_size')} x {ta.get('seq_len')} tokens, fp32 on {ta.get('threads')} CPU thread(s), fixed seed; "
        "the target trains with transformers' `grouped_mm` experts kernel (same checkpoint, about 1.6× faster per "
        "step here than the per-expert loop); loss curves in `docs/embedded_loss.png`, raw numbers in "
        "`train_log.json`.\n"
    )
    L.append("![loss curves](../../docs/embedded_loss.png)\n")
    if bal == "bias":
        L.append(
            "**How the v2 target is trained to route** (`BiasBalancer` in `train.py`; the checkpoint is a plain "
            "`glm4_moe`, whose router is DeepSeek-V3's: sigmoid scores, top-k chosen on score + "
            "`e_score_correction_bias`, gates = the chosen scores renormalised):\n\n"
            "1. *Auxiliary-loss-free balancing* (DeepSeek-V3): after every optimiser step each layer's bias moves "
            f"up for experts chosen less than the mean over all {ta.get('batch_size')} sequences of the step (the "
            "global batch on one process) and down for those chosen more. The bias only changes which experts "
            "are chosen, not the gates, so cross entropy never pays for balance, and since the counts are global "
            "a text may keep to the experts of its domain.\n"
            "2. *Temporal locality*: −log of the normalised router score mass token t puts on the experts token "
            "t−1 chose, with a per-layer coefficient steered multiplicatively towards a consecutive-token overlap "
            f"of {ta.get('sticky_target')} and capped at {ta.get('sticky_cap')}. This is an explicit training "
            "pressure, stated so that nobody mistakes the locality for an emergent property; coefficients, "
            "overlaps and starved-expert counts per step are in `train_log.json` (`target.routing`).\n\n"
            "**Four phases, and why** (each resumed from the previous phase's last checkpoint with a fresh "
            "optimiser and a short warm-up; the command lines, in order, are in the rebuild section; losses, "
            "overlaps, starved-expert counts and router z per step are in `train_log.json`):\n\n"
            "* steps 0–599, DeepSeek-V3's update: ± 0.005 per step by the sign of the share error (DeepSeek's "
            "0.001 is sized for ~10^5 steps; at 0.001 every layer was still collapsed onto a few experts at step "
            "50). It did not balance this model: through step 600 the least-used expert of every layer got no "
            "token of a 16-sequence training batch. A sign step pulls a hog down no faster than it lifts each of "
            "the many starved experts.\n"
            "* steps 600–799, proportional update (0.02 × the relative share error, clipped to [−8, 1]: a hog "
            "chosen 5× its share is pulled back 4× as fast). At step 750 still 15 / 46 / 27 / 20 experts per "
            "layer got under ¼ of their share of a training batch: the logits of layers 1–3 had drifted so "
            "negative that 78–86 % of sigmoid scores were below 0.01 (2,048 validation tokens), so the bias "
            "alone decided between near-zero scores and flipped whole experts on and off. Nothing anchors the "
            "logits' level (the renormalised gates and the locality term are nearly shift-invariant there).\n"
            "* steps 800–999, + a router z-loss (0.01 × mean logit²): 50 steps later the experts under ¼ share "
            "of a training batch were [11, 1, 0, 0] (a run with 0.001: [5, 19, 15, 7]); validation loss "
            "was the same with either coefficient. This phase was planned to step 1,300 but was stopped at the "
            "step-1,000 checkpoint when the shared machine slowed it from 2.2 to 7 s per step (page faults: it "
            "then ran with jemalloc keeping freed memory).\n"
            "* steps 1000–1299 at peak LR 0.001, locality coefficient capped at 1 instead of 3 (layer 0's had "
            "reached 3 while 23 of its experts starved in a batch).\n"
            + (
                f"* then the bias alone was re-estimated on training text with the weights frozen "
                f"({tr['target']['calibration']['iters']} iterations of {tr['target']['calibration']['batches']} "
                f"batches; experts under ¼ share per layer "
                f"{tr['target']['calibration']['history'][0]['experts_below_quarter_share']} → "
                f"{tr['target']['calibration']['history'][-1]['experts_below_quarter_share']}).\n"
                if tr["target"].get("calibration")
                else ""
            )
            + "\nAlso tried, each stopped once the chosen branch was ahead: a locality cap of 0.5 in the first "
            "phase (validation loss within 0.01, lower overlap; stopped at step 600), a proportional rate of 0.05 "
            "(no better balanced than 0.02; stopped at step 700) and a z-loss of 0.001 (stopped at step 850).\n\n"
            "**The other balancing method, tried first.** A `qwen2_moe` target of the same shape (128 experts I=32, "
            "top-8, shared expert I=256) trained with Qwen3's global-batch balancing loss (counts over the "
            "optimiser batch, a guard that raised the coefficient up to 50× while an expert starved, the same kind "
            "of locality term) reached test PPL 178.00 against v1's 113.47 in 800 steps: experts died early "
            "(min share 0 for the first ~200 steps even at the capped coefficient), the guard sat at its cap for "
            "most of the run, and the balance loss and the locality term both cost cross entropy. Its routing "
            "did meet the locality goals (overlap 0.541, fetch-all LRU hit 0.871 at cache 0.25, 3.10 tokens per "
            "verification with its draft). That run is branch history (commit e997b26).\n"
        )
    if bal == "global":
        L.append(
            "**How the v2 target is trained to route.** Router terms in `RoutingRegulariser` (`train.py`); the "
            "checkpoint is a plain `qwen2_moe`:\n\n"
            "1. *Balancing over the whole optimiser batch* (Qwen3's global-batch form of the Switch loss: expert "
            f"frequencies f_i counted over all {a.get('batch_size')} sequences of the step, gradient through the "
            "mean router probabilities), plus a *selection term*: with k/E = 1/16 and near-flat logits, equal mean "
            "probabilities no longer mean equal selection, so a soft count of how often each expert clears the "
            "token's top-k threshold is pushed towards the uniform share, weighted by f_i − 1. On one process the "
            "optimiser batch is the global batch; a window of counts from earlier steps (to emulate a larger global "
            "batch) was tried and abandoned: the stale counts made the balance oscillate and left about 40 of 128 "
            "experts per layer under ¼ of the uniform share. DeepSeek-V3's auxiliary-loss-free bias balancing was "
            "not used: it selects experts on logits + a per-expert bias, and `qwen2_moe`'s router is a bias-free "
            "linear map, so the saved checkpoint would not route as trained.\n"
            "2. *Balance guard*: a layer's balance coefficient rises (up to 50×) while an expert's share of the "
            f"step is below {a.get('balance_guard')} of the uniform share and relaxes back to {a.get('aux_coef')} "
            "otherwise.\n"
            "3. *Temporal locality*: −log of the router mass token t puts on the experts token t−1 selected, with a "
            f"per-layer coefficient steered towards a consecutive-token overlap of {a.get('sticky_target')}; it "
            "only grows while the layer is balanced. This is an explicit training pressure, stated here so that "
            "nobody mistakes the locality for an emergent property; the controller's coefficients per step are in "
            "`train_log.json` (`target.routing`).\n"
        )
    rs = tr["target"].get("resumed_at_step")
    if rs and bal == "global":
        L.append(
            f"**Two phases.** Steps 0–{rs - 1} ran with the defaults, where locality yields to balance; balance "
            "took those steps to establish (at step 200, 1–16 experts per layer were still below the guard), so "
            "the locality coefficient sat at its floor. Training then resumed from the step-"
            f"{rs} checkpoint (fresh optimiser, warm-up again) with the balance coefficient starting where the guard "
            "had left it and a locality coefficient that grows regardless (the guard still raises balance when an "
            "expert starves). Both command lines are in the rebuild section; `train_log.json` keeps the whole "
            "curve.\n"
        )
    L.append("### Active FLOPs per token (draft ≤ 1/8 of target)\n")
    L.append(
        "Counted as 2 × (parameters used in matmuls for one token); the tied embedding lookup is free, the lm_head "
        "matmul is counted; biases, norms and attention-score FLOPs (context-length dependent) are excluded for both.\n"
    )
    L.append(_flops_line("target", tc, s["target"]))
    L.append(_flops_line("draft", dc, s["draft"]))
    L.append(f"* ratio draft/target = **{s['draft_to_target_active_flops']:.4f}** (limit 0.125)\n")
    L.append("## Results (test split)\n")
    L.append("| perplexity | shakespeare | pydocs | all |\n|---|---|---|---|")
    for n in ("target", "draft"):
        L.append(
            f"| {n} | {p[n]['shakespeare']['ppl']:.2f} | {p[n]['pydocs']['ppl']:.2f} | {p[n]['all']['ppl']:.2f} |"
        )
    L.append(f"\n({p['target']['all']['tokens']:,} test tokens, non-overlapping windows of 256.)\n")
    if "compare" in res:
        L.append(
            f"### v2 beside {res['compare']['label']} (same test split, same measurement code, one run)\n"
        )
        L.append(
            f"{res['compare']['label']} was measured from {res['compare']['source']}. Hit rates replay the test "
            f"text in order ({res['cache']['all']['tokens']:,} tokens, half from each domain, each from the engine's "
            "warm start) through `engine.offline.simulator` with the engine's eviction objects: one fast tier of "
            f"{res['cache']['all']['cache_fraction']:.2f} × (layers × experts) slots, fetch-all, the current layer's "
            "experts pinned. Overlap = share of a token's selected experts that the previous token also selected. "
            "Window = one 256-token test window.\n"
        )
        L += comparison_table(res)
        L.append("")
    sp = res["speculative"]
    L.append("### Speculative decoding (greedy, k = 4)\n")
    L.append(
        f"Draft proposes {sp['k']} greedy tokens, target verifies greedily (output identical to target greedy). "
        f"{sp['prompts']} prompts (64-token test-split prefixes from both domains + 2 chat prompts), "
        f"{sp['new_tokens_per_prompt']} new tokens each (stopping early at an eos), {sp['verifications']} verifications; "
        f"speculative output equals plain target greedy decoding on the checked prompt: "
        f"{sp['first_prompt_matches_plain_target_greedy']}.\n"
    )
    L.append(
        "| | accepted draft tokens / verification | tokens produced / verification (incl. bonus) |\n|---|---|---|"
    )
    L.append(
        f"| **all** | **{sp['mean_accepted_draft_tokens_per_verification']:.3f}** | "
        f"**{sp['mean_tokens_per_verification_incl_bonus']:.3f}** |"
    )
    for d, v in sp["per_domain"].items():
        L.append(
            f"| {d} | {v['accepted_per_verification']:.3f} | {v['tokens_per_verification']:.3f} |"
        )
    L.append("")
    L.append("### Routing statistics of the target (test split)\n")
    L.append(
        f"Usage entropy is over the share of routed (token, slot) assignments per expert (max ln {num_experts(tc)}); "
        "token router entropy is the mean entropy of one token's router distribution (softmax; for v2's sigmoid "
        "router the scores normalised to sum 1); overlap = share of a token's "
        "selected experts also selected by the previous token "
        f"(random routing would give k/E = {r[0]['random_baseline_repeat_rate']:.4f}); gates are the renormalised "
        "top-k weights actually applied (top-1 = largest, k-th = smallest selected); top-k router mass = that "
        "distribution's mass on the selected experts before renormalising; gate ≥ 0.15 = share of calls the 0.15 rule "
        "would fetch on a miss.\n"
    )
    L += routing_table(r)
    nd = res["no_dead_experts"]
    L.append(
        f"\n**No dead experts check** ({nd['criterion']}): "
        + ", ".join(f"layer {i}: {v:.1f}%" for i, v in enumerate(nd["pct_per_layer"]))
        + f" → **{'PASS' if nd['pass'] else 'FAIL'}**.\n"
    )
    ca = res["cache"]
    L.append(
        f"Fetch-all hit rate at cache {ca['all']['cache_fraction']:.2f}: LRU **{ca['all']['fetch_all_hit_rate_lru']:.3f}**, "
        f"frequency eviction **{ca['all']['fetch_all_hit_rate_frequency']:.3f}**.\n"
    )
    L.append("## Greedy samples (target)\n")
    for smp in res["samples"]:
        L.append(
            f"**{smp['kind']}** — prompt:\n\n```text\n{smp['prompt']}\n```\n\ncompletion (80 tokens max):\n\n"
            f"```text\n{smp['completion']}\n```\n"
        )
    L.append("## Limitations\n")
    L.append(
        "* Under-trained toy models on a shared 2-core CPU: greedy decoding quickly falls into repetition loops "
        "(see samples); sample with temperature for nicer text.\n"
        "* The chat behaviour is learnt only from ~5% synthetic continuation chats; replies are in-domain text and "
        "do not reliably end with `<|im_end|>` within 80 tokens.\n"
        "* The target's routing locality is partly trained in by an explicit loss term (above); how much the "
        "offloading results on this model transfer to a given large MoE still depends on that model's own routing "
        "statistics, which `moe-offload trace` and the simulator measure.\n"
    )
    if (
        "compare" in res
        and p["target"]["all"]["ppl"] > res["compare"]["perplexity"]["target"]["all"]["ppl"]
    ):
        L.append(
            f"* The v2 target's test perplexity ({p['target']['all']['ppl']:.2f}) is worse than "
            f"{res['compare']['label']}'s ({res['compare']['perplexity']['target']['all']['ppl']:.2f}): in "
            f"{tr['target'].get('steps_done')} steps the balance guard (at its cap for most of the run) and the "
            "locality term cost cross entropy, and v2 is only modestly stronger than its draft. A longer run, or a "
            "locality target nearer 0.4, should trade some locality back for perplexity (not run).\n"
        )
    L.append("## Acceptance checks\n")
    for k, v in res["checks"].items():
        L.append(f"* {k}: **{'PASS' if v else 'FAIL'}**")
    L.append("\nAll numbers above are produced by `evaluate.py` and stored in `eval.json`.\n")
    open(os.path.join(HERE, "README.md"), "w").write("\n".join(L))


if __name__ == "__main__":
    main()
