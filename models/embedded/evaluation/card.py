"""The model card, models/embedded/README.md: written section by section from eval.json's results
(and the models' configs), so `evaluate.py --card-only` can rewrite it without measuring again."""

from __future__ import annotations

import os

from models.embedded.evaluation.card_tables import (
    comparison_table,
    flops_line,
    mlp_desc,
    routing_table,
)
from models.embedded.evaluation.card_training import (
    Card,
    bias_story,
    global_story,
    loss_and_training,
    mins,
)
from models.embedded.evaluation.routing import num_experts
from models.embedded.training.paths import HERE


def stage_args(tr: dict) -> tuple[dict, dict, str]:
    """(last stage's args, the target stage's args, the target's balancing)."""
    a = tr.get("args") or {}
    # the target stage's own settings (the log's top-level args are the last stage's)
    ta = tr["target"].get("args")
    if not ta and tr["target"].get("argv"):
        from models.embedded.training.args import build_parser

        ta = vars(build_parser(None).parse_args(tr["target"]["argv"]))
    ta = ta or a
    bal = "bias" if ta.get("arch") == "glm4_moe" else a.get("balance", "micro")
    return a, ta, bal


def write_card(res, target, draft):
    a, ta, bal = stage_args(res["training"])
    x = Card(res, target, draft, a, ta, bal)
    L: list[str] = []
    for section in (
        intro_and_rebuild,
        corpus_and_tokenizer,
        models_table,
        loss_and_training,
        bias_story,
        global_story,
        flops_and_perplexity,
        speculation_and_routing,
        samples_limits_and_checks,
    ):
        L += section(x)
    open(os.path.join(HERE, "README.md"), "w").write("\n".join(L))


def intro_and_rebuild(x: Card) -> list[str]:
    """Title, what the pair is, its files and the commands that rebuild it."""
    tc, tr, a = x.target.config, x.tr, x.a
    L: list[str] = []
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
        "* `corpus_stats.json`, `train_log.json`, `eval.json`; scripts `build_corpus.py`, `train.py` (its stages in `training/`), `evaluate.py` (its stages in `evaluation/`)\n"
        "* `long/`: the long-context pair, the same two models fine-tuned on 4096-token windows with a 4096-token context (`train.py --stage long`, evaluated by `long_eval.py`): [its card](long/README.md)\n"
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
    return L


def corpus_and_tokenizer(x: Card) -> list[str]:
    """The two text domains, their splits and the tokenizer."""
    c = x.res["corpus"]
    L: list[str] = []
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
    return L


def models_table(x: Card) -> list[str]:
    """Both models' shapes, sizes and training time side by side."""
    target, draft, tr, s = x.target, x.draft, x.tr, x.res["sizes"]
    tc, dc = target.config, draft.config
    L: list[str] = []
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
    L.append(f"| MLP | {mlp_desc(tc)} | dense SwiGLU, intermediate {dc.intermediate_size} |")
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
    return L


def flops_and_perplexity(x: Card) -> list[str]:
    """Active FLOPs per token, test perplexity, and the comparison pair."""
    res, s, p = x.res, x.res["sizes"], x.res["perplexity"]
    tc, dc = x.target.config, x.draft.config
    L: list[str] = []
    L.append("### Active FLOPs per token (draft ≤ 1/8 of target)\n")
    L.append(
        "Counted as 2 × (parameters used in matmuls for one token); the tied embedding lookup is free, the lm_head "
        "matmul is counted; biases, norms and attention-score FLOPs (context-length dependent) are excluded for both.\n"
    )
    L.append(flops_line("target", tc, s["target"]))
    L.append(flops_line("draft", dc, s["draft"]))
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
    return L


def speculation_and_routing(x: Card) -> list[str]:
    """Speculative acceptance, routing statistics, dead experts, hit rates."""
    res, r, tc = x.res, x.res["routing"], x.target.config
    L: list[str] = []
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
    return L


def samples_limits_and_checks(x: Card) -> list[str]:
    """Greedy samples, limitations and the acceptance checks."""
    res, p, tr = x.res, x.res["perplexity"], x.tr
    L: list[str] = []
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
    return L
