"""Evaluate the embedded model pair with plain transformers and write
models/embedded/eval.json and the model card models/embedded/README.md.

Measures: test-split perplexity (per domain and overall) of target and draft, routing statistics
of the MoE target on the test split, the dead-expert check, greedy speculative-decoding acceptance
of the draft at k=4 (simulated: draft proposes k greedy tokens, target verifies greedily), and
three greedy samples.

Usage:  python -m models.embedded.evaluate [--seq-len 256] [--spec-prompts 24] [--spec-new-tokens 96]
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
    return [torch.from_numpy(ids[i * T: i * T + T + 1]) for i in range(n)]


@torch.no_grad()
def perplexity(model, wins, batch):
    tot, n = 0.0, 0
    for i in range(0, len(wins), batch):
        x = torch.stack(wins[i:i + batch])
        logits = model(input_ids=x[:, :-1]).logits.float()
        tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    return {"nll": tot / n, "ppl": math.exp(tot / n), "tokens": n}


@torch.no_grad()
def routing_stats(model, wins, batch, T):
    cfg = model.config
    E, k, L = cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers
    counts = np.zeros((L, E), dtype=np.int64)
    rep_any, rep_top1, n_pairs = np.zeros(L), np.zeros(L), 0
    top1_w = [[] for _ in range(L)]
    top1_raw = [[] for _ in range(L)]
    for i in range(0, len(wins), batch):
        x = torch.stack(wins[i:i + batch])[:, :-1]
        B = x.size(0)
        out = model(input_ids=x, output_router_logits=True)
        for l, rl in enumerate(out.router_logits):
            probs = F.softmax(rl.float(), dim=-1)
            topv, topi = torch.topk(probs, k, dim=-1)
            w = topv / topv.sum(-1, keepdim=True) if cfg.norm_topk_prob else topv
            counts[l] += np.bincount(topi.reshape(-1).numpy(), minlength=E)
            top1_w[l].append(w[:, 0].numpy())
            top1_raw[l].append(topv[:, 0].numpy())
            sel = torch.zeros(B * T, E, dtype=torch.bool)
            sel.scatter_(1, topi, True)
            sel = sel.view(B, T, E)
            inter = (sel[:, 1:] & sel[:, :-1]).sum(-1).float() / k  # share of experts reused from previous token
            rep_any[l] += inter.sum().item()
            t1 = topi.view(B, T, k)[:, :, 0]
            rep_top1[l] += (t1[:, 1:] == t1[:, :-1]).float().sum().item()
        n_pairs += B * (T - 1)
    layers = []
    qs = [0.05, 0.25, 0.5, 0.75, 0.95]
    for l in range(L):
        share = counts[l] / counts[l].sum()
        ent = float(-(share[share > 0] * np.log(share[share > 0])).sum())
        w = np.concatenate(top1_w[l])
        raw = np.concatenate(top1_raw[l])
        alive = share >= 0.25 / E
        layers.append({
            "layer": l,
            "routed_assignments": int(counts[l].sum()),
            "usage_entropy_nats": ent,
            "usage_entropy_normalized": ent / math.log(E),
            "experts_never_routed_share": float((counts[l] == 0).mean()),
            "experts_ge_quarter_uniform_pct": float(100 * alive.mean()),
            "min_expert_share_vs_uniform": float(share.min() * E),
            "max_expert_share_vs_uniform": float(share.max() * E),
            "repeat_rate_selected_experts": float(rep_any[l] / n_pairs),
            "repeat_rate_top1_expert": float(rep_top1[l] / n_pairs),
            "random_baseline_repeat_rate": k / E,
            "top1_gate_weight_normalized_quantiles": {f"q{int(q * 100):02d}": float(np.quantile(w, q)) for q in qs},
            "top1_router_prob_quantiles": {f"q{int(q * 100):02d}": float(np.quantile(raw, q)) for q in qs},
        })
    return layers


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
        tgt = logits[len(ids) - 1:].argmax(-1).tolist()  # k+1 target greedy tokens
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
    return {"rounds": rounds, "accepted": accepted_total, "produced": produced, "ids": ids[len(prompt):]}


@torch.no_grad()
def generate(model, tok, ids, n):
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, len(ids):], skip_special_tokens=False)


def file_mb(d):
    return os.path.getsize(os.path.join(d, "model.safetensors")) / 1e6


def fmt(x, nd=3):
    return f"{x:.{nd}f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=256, help="window length for perplexity / routing stats")
    ap.add_argument("--batch", type=int, default=16, help="windows per forward pass")
    ap.add_argument("--max-windows", type=int, default=0, help="cap windows per domain (0 = whole test split)")
    ap.add_argument("--spec-prompts", type=int, default=24, help="prompts for the speculative-decoding simulation")
    ap.add_argument("--spec-prompt-len", type=int, default=64, help="prompt length (tokens) taken from the test split")
    ap.add_argument("--spec-new-tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--k", type=int, default=4, help="draft tokens proposed per verification")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads value")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.embedded.train import active_params

    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32).eval()
    target.config.output_router_logits = False  # no aux-loss work during plain forwards
    res = {"corpus": json.load(open(os.path.join(HERE, "corpus_stats.json")))}
    log = json.load(open(os.path.join(HERE, "train_log.json"))) if os.path.exists(os.path.join(HERE, "train_log.json")) else {}

    # ---- sizes
    ta, da = active_params(target.config), active_params(draft.config)
    res["sizes"] = {
        name: {"params": int(sum(p.numel() for p in m.parameters())),
               "safetensors_MB": file_mb(d), "dtype": "bfloat16", **ap_}
        for name, m, d, ap_ in [("target", target, TARGET_DIR, ta), ("draft", draft, DRAFT_DIR, da)]}
    res["sizes"]["draft_to_target_active_flops"] = da["flops_per_token"] / ta["flops_per_token"]
    res["training"] = {n: {k: log.get(n, {}).get(k) for k in ("steps_done", "train_seconds", "tokens_per_step", "valid", "resumed_at_step",
                                                         "seconds_before_resume")}
                       for n in ("target", "draft")}
    res["training"]["args"] = log.get("args")

    # ---- perplexity
    wins = {}
    for dom in ("shakespeare", "pydocs"):
        w = windows(load_ids(tok, os.path.join(DATA, f"test_{dom}.txt")), args.seq_len)
        wins[dom] = w[: args.max_windows] if args.max_windows else w
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
        print(name, {d: round(v["ppl"], 2) for d, v in ppl[name].items()}, flush=True)
    res["perplexity"] = ppl

    # ---- routing
    allw = wins["shakespeare"] + wins["pydocs"]
    res["routing"] = routing_stats(target, allw, args.batch, args.seq_len)
    res["no_dead_experts"] = {
        "criterion": ">= 95% of experts in every layer receive >= 1/4 of the uniform share of routed tokens (test split)",
        "pct_per_layer": [l["experts_ge_quarter_uniform_pct"] for l in res["routing"]],
        "pass": all(l["experts_ge_quarter_uniform_pct"] >= 95.0 for l in res["routing"]),
    }
    print("routing", res["no_dead_experts"], flush=True)

    # ---- speculative decoding
    rng = np.random.default_rng(0)
    per_dom = args.spec_prompts // 2
    spec_rows = []
    for dom in ("shakespeare", "pydocs"):
        ids = load_ids(tok, os.path.join(DATA, f"test_{dom}.txt"))
        for s in rng.choice(len(ids) - args.spec_prompt_len - 1, size=per_dom, replace=False):
            prompt = ids[s: s + args.spec_prompt_len].tolist()
            r = speculative(target, draft, prompt, args.spec_new_tokens, args.k)
            r["domain"] = dom
            r["prompt"] = prompt
            spec_rows.append(r)
    # chat prompts too
    for q in ["Continue the scene:\nHAMLET\nTo be, or not to be, that is the question.",
              "Tell me about Python."]:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        r = speculative(target, draft, list(prompt), args.spec_new_tokens, args.k)
        r["domain"] = "chat"
        r["prompt"] = list(prompt)
        spec_rows.append(r)
    # exactness check: speculative output equals plain target greedy for the first prompt
    first = spec_rows[0]
    plain = list(first["prompt"])
    for _ in range(len(first["ids"])):
        plain.append(greedy_next(target, plain))
    exact = plain[len(first["prompt"]):] == first["ids"]
    R = sum(r["rounds"] for r in spec_rows)
    spec = {"k": args.k, "prompts": len(spec_rows), "new_tokens_per_prompt": args.spec_new_tokens,
            "verifications": R,
            "mean_accepted_draft_tokens_per_verification": sum(r["accepted"] for r in spec_rows) / R,
            "mean_tokens_per_verification_incl_bonus": sum(r["produced"] for r in spec_rows) / R,
            "first_prompt_matches_plain_target_greedy": exact,
            "per_domain": {}}
    for dom in ("shakespeare", "pydocs", "chat"):
        rr = [r for r in spec_rows if r["domain"] == dom]
        Rd = sum(r["rounds"] for r in rr)
        spec["per_domain"][dom] = {"verifications": Rd,
                                   "accepted_per_verification": sum(r["accepted"] for r in rr) / Rd,
                                   "tokens_per_verification": sum(r["produced"] for r in rr) / Rd}
    spec["pass_ge_1_5_tokens_per_verification"] = spec["mean_tokens_per_verification_incl_bonus"] >= 1.5
    res["speculative"] = spec
    print("spec", {k: v for k, v in spec.items() if k != "per_domain"}, flush=True)

    # ---- samples
    samples = []
    for kind, text in [("shakespeare", "ROMEO\nBut soft, what light through yonder window breaks?\n"),
                       ("pydocs", "The json module provides")]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        samples.append({"kind": kind, "prompt": text, "completion": generate(target, tok, ids, 80)})
    msgs = [{"role": "user", "content": "Continue the scene:\nHAMLET\nTo be, or not to be, that is the question."}]
    chat_text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(chat_text, add_special_tokens=False)["input_ids"]
    samples.append({"kind": "chat", "prompt": chat_text, "completion": generate(target, tok, ids, 80)})
    res["samples"] = samples
    res["eval_seconds"] = time.time() - t_start

    checks = {
        "target_ppl_below_draft": ppl["target"]["all"]["ppl"] < ppl["draft"]["all"]["ppl"],
        "target_le_40MB": res["sizes"]["target"]["safetensors_MB"] <= 40.0,
        "draft_le_eighth_active_flops": res["sizes"]["draft_to_target_active_flops"] <= 0.125,
        "no_dead_experts": res["no_dead_experts"]["pass"],
        "spec_tokens_per_verification_ge_1_5": spec["pass_ge_1_5_tokens_per_verification"],
    }
    res["checks"] = checks
    json.dump(res, open(os.path.join(HERE, "eval.json"), "w"), indent=2)
    write_card(res, target, draft)
    print(json.dumps(checks, indent=2))


def write_card(res, target, draft):
    c, s, p, r = res["corpus"], res["sizes"], res["perplexity"], res["routing"]
    tr = res["training"]
    tc, dc = target.config, draft.config
    a = tr.get("args") or {}

    def mins(x):
        return f"{x / 60:.1f} min" if x else "n/a"

    L = []
    L.append("# Embedded default model pair (`models/embedded`)\n")
    L.append("A tiny Qwen3-MoE **target** and a dense Qwen3 **draft** trained from scratch on CPU on two public-domain/"
             "permissively licensed text domains, shipped as the project's default model pair for offloading and "
             "speculative-decoding tests. They are toy-quality language models: they write Shakespeare-like verse and "
             "Python-documentation-like prose, not correct answers.\n")
    L.append("## Files\n")
    L.append("* `target/`, `draft/`: `config.json`, `model.safetensors` (bf16), `generation_config.json`, `tokenizer.json`, "
             "`tokenizer_config.json`, `chat_template.jinja` (the same tokenizer in both)\n"
             "* `data/`: `valid.txt`, `test.txt` and per-domain `valid_*.txt`, `test_*.txt` (documents separated by "
             "`\\n<|endoftext|>\\n`)\n"
             "* `corpus_stats.json`, `train_log.json`, `eval.json`; scripts `build_corpus.py`, `train.py`, `evaluate.py`\n")
    L.append("## Rebuild\n")
    L.append("```bash\n.venv/bin/python -m models.embedded.build_corpus   # corpus splits + BPE tokenizer (deterministic)\n"
             ".venv/bin/python -m models.embedded.train          # target then draft (see --help)\n"
             ".venv/bin/python -m models.embedded.evaluate       # writes eval.json and this README\n```\n")
    if a:
        L.append(f"Training run recorded here used: `--target-minutes {a.get('target_minutes')} --draft-minutes "
                 f"{a.get('draft_minutes')}` (seq {a.get('seq_len')}, batch {a.get('batch_size')}, seed {a.get('seed')}, "
                 f"{a.get('threads')} threads). The step count follows a wall-clock budget (cosine schedule over "
                 "elapsed time), so a rerun on a different machine gives a different step count; pass "
                 "`--target-steps/--draft-steps` for a step-exact rerun.\n")
    L.append("## Corpus\n")
    L.append(f"* **shakespeare**: {c['source']['shakespeare']}; markdown stripped (bold speaker names, headings, "
             "italic stage directions).\n")
    L.append(f"* **pydocs**: Python 3.11 documentation sources ({c['source']['pydocs']}, Debian package "
             "`python3.11-doc`: tutorial, library, howto, reference, faq, using, extending, glossary); reST roles, "
             "directives and heading underlines removed; capped to the size of the Shakespeare domain.\n")
    L.append(f"* Splits are by whole document (play / doc page), seeded (seed {c['seed']}); the documents of each "
             "split are listed in `corpus_stats.json`. `data/` ships `valid*.txt` and `test*.txt`; `train.txt` is "
             "rebuilt by `build_corpus.py` (git-ignored).\n")
    L.append("| domain | train bytes | valid bytes | test bytes | docs train/valid/test |\n|---|---|---|---|---|")
    for d in ("shakespeare", "pydocs"):
        b, n = c["bytes"][d], c["documents"][d]
        L.append(f"| {d} | {b['train']:,} | {b['valid']:,} | {b['test']:,} | {n['train']}/{n['valid']}/{n['test']} |")
    b = c["bytes"]["total"]
    L.append(f"| total | {b['train']:,} | {b['valid']:,} | {b['test']:,} | |\n")
    L.append("About 5% of training rows are synthetic single-turn chats "
             "(`<|im_start|>user\\nContinue the scene:\\n<passage><|im_end|>\\n<|im_start|>assistant\\n<next passage><|im_end|>`), "
             "so a chat-formatted prompt produces text and ends with `<|im_end|>`.\n")
    L.append("## Tokenizer\n")
    L.append("Byte-level BPE, vocab 8192, trained with `tokenizers` on the train split. Special tokens: "
             "`<|endoftext|>`=0 (eos, document separator), `<|bos|>`=1, `<|pad|>`=2, `<|im_start|>`=3, `<|im_end|>`=4. "
             "No token is added automatically. ChatML chat template (`<|im_start|>{role}\\n{content}<|im_end|>\\n`, "
             "`add_generation_prompt` appends `<|im_start|>assistant\\n`). `generation_config.json` stops on "
             "`eos_token_id=[0, 4]`.\n")
    L.append("## Models\n")
    L.append("| | target | draft |\n|---|---|---|")
    L.append(f"| architecture | `Qwen3MoeForCausalLM` | `Qwen3ForCausalLM` (dense) |")
    L.append(f"| layers / hidden | {tc.num_hidden_layers} / {tc.hidden_size} | {dc.num_hidden_layers} / {dc.hidden_size} |")
    L.append(f"| heads / kv heads / head_dim | {tc.num_attention_heads} / {tc.num_key_value_heads} / {tc.head_dim} | "
             f"{dc.num_attention_heads} / {dc.num_key_value_heads} / {dc.head_dim} |")
    L.append(f"| MLP | {tc.num_experts} routed experts per layer (every layer sparse), top-{tc.num_experts_per_tok}, "
             f"moe_intermediate_size {tc.moe_intermediate_size}, norm_topk_prob | dense SwiGLU, intermediate {dc.intermediate_size} |")
    L.append(f"| vocab / tied embeddings / max positions | {tc.vocab_size} / yes / {tc.max_position_embeddings} | "
             f"{dc.vocab_size} / yes / {dc.max_position_embeddings} |")
    L.append(f"| parameters | {s['target']['params']:,} | {s['draft']['params']:,} |")
    L.append(f"| model.safetensors (bf16) | {s['target']['safetensors_MB']:.2f} MB | {s['draft']['safetensors_MB']:.2f} MB |")
    L.append(f"| active params / token (matmuls) | {s['target']['active_params']:,} | {s['draft']['active_params']:,} |")
    L.append(f"| training | {tr['target'].get('steps_done')} steps, {mins(tr['target'].get('train_seconds'))} | "
             f"{tr['draft'].get('steps_done')} steps, {mins(tr['draft'].get('train_seconds'))} |")
    rs = tr["target"].get("resumed_at_step")
    aux_txt = (f"CE + {tc.router_aux_loss_coef} × load-balancing aux loss computed per layer"
               + (f" (steps 0–{rs - 1} used transformers' layer-pooled aux loss, see below; resumed from the step-{rs} "
                  "checkpoint with the per-layer loss and a fresh optimiser)" if rs else ""))
    L.append(f"| loss | {aux_txt} | "
             f"{1 - (a.get('distill_alpha') or 0):.1f} x CE + {a.get('distill_alpha')} x KL(target ‖ draft) distillation |\n")
    L.append("Training: AdamW (β=0.9/0.95, wd 0.05 on matrices), linear warm-up then cosine to 10% of peak, grad clip 1, "
             f"batch {a.get('batch_size')} x {a.get('seq_len')} tokens, fp32 on {a.get('threads')} CPU thread(s), fixed seed; "
             "loss curves in `docs/embedded_loss.png`, raw numbers in `train_log.json`.\n")
    L.append("![loss curves](../../docs/embedded_loss.png)\n")
    if rs:
        L.append("**Training history of the target.** The first run used transformers' built-in "
                 "`load_balancing_loss_func`, which sums expert counts and router probabilities over all layers "
                 "before multiplying them, so per-layer imbalance is barely penalised: at step 200 only 55–61% of "
                 "the experts of each layer got ≥ 1/4 of the uniform share of tokens. That run was stopped and "
                 f"training continued from its step-{rs} checkpoint with a per-layer Switch-style aux loss "
                 "(`per_layer_aux_loss` in `train.py`, the default now), which brought every layer to 100% within "
                 "200 steps. A from-scratch rerun of `train.py` uses the per-layer loss from step 0 (not run here). "
                 "Training times include both phases; `train_log.json` keeps the whole curve (aux values before "
                 f"step {rs} are the pooled loss).\n")
    L.append("### Active FLOPs per token (draft ≤ 1/8 of target)\n")
    L.append("Counted as 2 × (parameters used in matmuls for one token); the tied embedding lookup is free, the lm_head "
             "matmul is counted; attention-score FLOPs (context-length dependent) are excluded for both.\n")
    for n, cfg in (("target", tc), ("draft", dc)):
        x = s[n]
        L.append(f"* {n}: per layer attention q/k/v/o = {x['attention_per_layer']:,}, "
                 + (f"MLP = top-{cfg.num_experts_per_tok} × 3 × {cfg.hidden_size} × {cfg.moe_intermediate_size} + router "
                    f"{cfg.hidden_size} × {cfg.num_experts} = {x['mlp_per_layer']:,}"
                    if n == "target" else f"MLP = 3 × {cfg.hidden_size} × {cfg.intermediate_size} = {x['mlp_per_layer']:,}")
                 + f"; × {cfg.num_hidden_layers} layers + lm_head {cfg.hidden_size} × {cfg.vocab_size} = "
                 f"{x['lm_head']:,} → {x['active_params']:,} active params → **{x['flops_per_token']:,} FLOPs/token**")
    L.append(f"* ratio draft/target = **{s['draft_to_target_active_flops']:.4f}** (limit 0.125)\n")
    L.append("## Results (test split)\n")
    L.append("| perplexity | shakespeare | pydocs | all |\n|---|---|---|---|")
    for n in ("target", "draft"):
        L.append(f"| {n} | {p[n]['shakespeare']['ppl']:.2f} | {p[n]['pydocs']['ppl']:.2f} | {p[n]['all']['ppl']:.2f} |")
    L.append(f"\n({p['target']['all']['tokens']:,} test tokens, non-overlapping windows of 256.)\n")
    sp = res["speculative"]
    L.append("### Speculative decoding (greedy, k = 4)\n")
    L.append(f"Draft proposes {sp['k']} greedy tokens, target verifies greedily (output identical to target greedy). "
             f"{sp['prompts']} prompts (64-token test-split prefixes from both domains + 2 chat prompts), "
             f"{sp['new_tokens_per_prompt']} new tokens each (stopping early at an eos), {sp['verifications']} verifications; "
             f"speculative output equals plain target greedy decoding on the checked prompt: "
             f"{sp['first_prompt_matches_plain_target_greedy']}.\n")
    L.append("| | accepted draft tokens / verification | tokens produced / verification (incl. bonus) |\n|---|---|---|")
    L.append(f"| **all** | **{sp['mean_accepted_draft_tokens_per_verification']:.3f}** | "
             f"**{sp['mean_tokens_per_verification_incl_bonus']:.3f}** |")
    for d, v in sp["per_domain"].items():
        L.append(f"| {d} | {v['accepted_per_verification']:.3f} | {v['tokens_per_verification']:.3f} |")
    L.append("")
    L.append("### Routing statistics of the target (test split)\n")
    L.append("usage entropy is over the share of routed (token, slot) assignments per expert (max ln 64 = 4.159); "
             "repeat rate = share of a token's selected experts also selected by the previous token "
             f"(random routing would give k/E = {r[0]['random_baseline_repeat_rate']:.3f}); top-1 gate weight is the "
             "renormalised top-k weight actually applied to the top expert.\n")
    L.append("| layer | entropy (nats) | norm. entropy | never routed | ≥¼ uniform share | min / max share ÷ uniform | "
             "repeat (selected) | repeat (top-1) | top-1 gate weight q05 / q25 / q50 / q75 / q95 |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for l in r:
        q = l["top1_gate_weight_normalized_quantiles"]
        L.append(f"| {l['layer']} | {l['usage_entropy_nats']:.3f} | {l['usage_entropy_normalized']:.3f} | "
                 f"{100 * l['experts_never_routed_share']:.1f}% | {l['experts_ge_quarter_uniform_pct']:.1f}% | "
                 f"{l['min_expert_share_vs_uniform']:.2f} / {l['max_expert_share_vs_uniform']:.2f} | "
                 f"{l['repeat_rate_selected_experts']:.3f} | {l['repeat_rate_top1_expert']:.3f} | "
                 + " / ".join(f"{q[k]:.3f}" for k in ("q05", "q25", "q50", "q75", "q95")) + " |")
    nd = res["no_dead_experts"]
    L.append(f"\n**No dead experts check** ({nd['criterion']}): "
             + ", ".join(f"layer {i}: {v:.1f}%" for i, v in enumerate(nd["pct_per_layer"]))
             + f" → **{'PASS' if nd['pass'] else 'FAIL'}**.\n")
    L.append("## Greedy samples (target)\n")
    for smp in res["samples"]:
        L.append(f"**{smp['kind']}** — prompt:\n\n```text\n{smp['prompt']}\n```\n\ncompletion (80 tokens max):\n\n"
                 f"```text\n{smp['completion']}\n```\n")
    L.append("## Limitations\n")
    L.append("* Under-trained toy models (about one epoch for the target, ~0.4 epoch for the draft on a shared 2-core CPU): "
             "greedy decoding quickly falls into repetition loops (see samples); sample with temperature for nicer text.\n"
             "* The chat behaviour is learnt only from ~5% synthetic continuation chats; replies are in-domain text and "
             "do not reliably end with `<|im_end|>` within 80 tokens.\n"
             "* `output_router_logits` is `true` in the target config (as trained); inference code that does not want "
             "the router logits / aux loss computed can set it to false.\n")
    L.append("## Acceptance checks\n")
    for k, v in res["checks"].items():
        L.append(f"* {k}: **{'PASS' if v else 'FAIL'}**")
    L.append("\nAll numbers above are produced by `evaluate.py` and stored in `eval.json`.\n")
    open(os.path.join(HERE, "README.md"), "w").write("\n".join(L))


if __name__ == "__main__":
    main()
