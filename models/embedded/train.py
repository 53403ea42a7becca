"""Train the embedded default model pair (Qwen3-MoE target + dense Qwen3 draft) on the corpus
built by ``models/embedded/build_corpus.py``.

One command:   python -m models.embedded.train          (rebuilds the corpus/tokenizer if missing)

Stage 1 trains the MoE target with next-token cross entropy + the router load-balancing aux loss.
Stage 2 trains the dense draft with a mix of cross entropy and KL distillation from the trained
target's logits.  Weights (bf16 safetensors), generation_config.json and tokenizer files are saved
into models/embedded/target/ and models/embedded/draft/ every --save-every steps and at the end, so a
partial run leaves usable weights.  Loss curves go to docs/embedded_loss.png, raw numbers to
models/embedded/train_log.json.

The number of optimiser steps is either given (--target-steps / --draft-steps) or derived from a
wall-clock budget (--target-minutes / --draft-minutes): the script times a few warm-up steps and
sizes the cosine schedule to fit.  Batches are sampled with a fixed seed; only the step count
depends on measured speed when a minute budget is used (the chosen counts are logged).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(HERE, "data")
TARGET_DIR = os.path.join(HERE, "target")
DRAFT_DIR = os.path.join(HERE, "draft")
LOG_JSON = os.path.join(HERE, "train_log.json")
PLOT = os.path.join(ROOT, "docs", "embedded_loss.png")
DOC_SEP = "\n<|endoftext|>\n"

EOS_ID, BOS_ID, PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4


# ----------------------------------------------------------------------------- configs
def target_config(args):
    """v2 (default): qwen2_moe with a shared expert and fine-grained routed experts, shaped like
    Qwen1.5/Qwen2-MoE and Qwen3-Next (many small routed experts + an always-on shared expert) but tiny.
    v1: the original 64-expert qwen3_moe without a shared expert (kept for reproducing the old card)."""
    common = dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_dropout=0.0,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        # False: the trainer computes its own balance loss from the router logits it records, so the
        # model's own (layer-pooled) aux loss is never needed at inference.
        output_router_logits=False,
        router_aux_loss_coef=args.aux_coef,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
    )
    if args.arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        # DeepSeek-V3-style routing: sigmoid scores, top-k chosen on score + a per-expert correction bias (the
        # auxiliary-loss-free balancing buffer), gates = the chosen scores renormalised; one shared expert of
        # n_shared_experts x moe_intermediate_size; every layer sparse (first_k_dense_replace=0); one group.
        g = {
            k: v
            for k, v in common.items()
            if k
            not in (
                "num_experts",
                "decoder_sparse_step",
                "mlp_only_layers",
                "output_router_logits",
                "router_aux_loss_coef",
            )
        }
        g["rope_parameters"] = {**common["rope_parameters"], "partial_rotary_factor": 1.0}
        return Glm4MoeConfig(
            n_routed_experts=args.num_experts,
            n_shared_experts=args.shared_intermediate // args.moe_intermediate,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            attention_bias=True,
            use_qk_norm=False,
            num_mtp_layers=0,
            **g,
        )
    if args.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(attention_bias=False, **common)
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        shared_expert_intermediate_size=args.shared_intermediate,
        qkv_bias=True,
        use_sliding_window=False,
        **common,
    )


def draft_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=8192,
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
    )


def active_params(cfg) -> dict:
    """Parameters touched by matmuls for one token (lm_head counted once, embedding lookup free)."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", h // cfg.num_attention_heads)
    shared = 0
    attn = h * cfg.num_attention_heads * hd * 2 + h * cfg.num_key_value_heads * hd * 2  # q,o + k,v
    if getattr(cfg, "n_routed_experts", None):  # glm4_moe: shared expert without a gate
        mlp = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.n_routed_experts
        shared = cfg.n_shared_experts * cfg.moe_intermediate_size
        mlp += 3 * h * shared
    elif hasattr(cfg, "num_experts"):
        mlp = (
            cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.num_experts
        )  # experts + router
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        if shared:  # qwen2_moe: always-on shared expert + its 1-output sigmoid gate
            mlp += 3 * h * shared + h
    else:
        mlp = 3 * h * cfg.intermediate_size
    lm_head = h * cfg.vocab_size
    per_layer = attn + mlp
    total = L * per_layer + lm_head
    return {
        "attention_per_layer": attn,
        "mlp_per_layer": mlp,
        "lm_head": lm_head,
        "shared_expert_per_layer": (
            3 * h * shared + (0 if getattr(cfg, "n_routed_experts", None) else h)
        )
        if shared
        else 0,
        "active_params": total,
        "flops_per_token": 2 * total,
    }


# ----------------------------------------------------------------------------- data
def ensure_corpus():
    need = [os.path.join(DATA, "train.txt"), os.path.join(TARGET_DIR, "tokenizer.json")]
    if not all(os.path.exists(p) for p in need):
        from models.embedded import build_corpus

        build_corpus.main([])


def load_stream(tok, path, cache=None):
    tok_file = os.path.join(TARGET_DIR, "tokenizer.json")
    if (
        cache
        and os.path.exists(cache)
        and os.path.getmtime(cache) > max(os.path.getmtime(path), os.path.getmtime(tok_file))
    ):
        return np.load(cache)  # newer than both the text and the tokenizer that encoded it
    docs = [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d.strip()]
    ids = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(EOS_ID)
    arr = np.asarray(ids, dtype=np.int32)
    if cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        np.save(cache, arr)
    return arr


def build_chat_pool(tok, path, n, seed, n_shakes_docs):
    """Synthetic single-turn chats: user asks to continue a passage, assistant continues it."""
    rng = random.Random(seed)
    docs = [d for d in open(path, encoding="utf-8").read().split(DOC_SEP) if d.strip()]
    pool = []
    prompts_a = [
        "Continue the scene:\n{c}",
        "Continue this passage from the play:\n{c}",
        "Write the next lines.\n{c}",
    ]
    prompts_b = [
        "Continue this passage from the Python documentation:\n{c}",
        "Explain further:\n{c}",
        "Continue the text:\n{c}",
    ]
    bare_a = [
        "Continue the scene.",
        "Write a short scene.",
        "Say something in the style of Shakespeare.",
    ]
    bare_b = [
        "Tell me about Python.",
        "Explain a Python module.",
        "Write some Python documentation.",
    ]
    while len(pool) < n:
        di = rng.randrange(len(docs))
        shakes = di < n_shakes_docs
        paras = [p for p in docs[di].split("\n\n") if p.strip()]
        if len(paras) < 3:
            continue
        i = rng.randrange(len(paras) - 2)
        ctx = paras[i][:300]
        resp, j = "", i + 1
        while j < len(paras) and len(resp) < 500:
            resp += ("\n\n" if resp else "") + paras[j]
            j += 1
        if rng.random() < 0.25:
            user = rng.choice(bare_a if shakes else bare_b)
        else:
            user = rng.choice(prompts_a if shakes else prompts_b).format(c=ctx)
        text = (
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{resp[:800]}<|im_end|>\n"
        )
        ids = tok(text, add_special_tokens=False)["input_ids"] + [EOS_ID]
        pool.append(np.asarray(ids, dtype=np.int32))
    return pool


class Batcher:
    def __init__(self, stream, chat_pool, seq_len, batch, chat_frac, seed):
        self.s, self.pool, self.T, self.B, self.cf = stream, chat_pool, seq_len, batch, chat_frac
        self.rng = np.random.default_rng(seed)

    def next(self):
        out = np.empty((self.B, self.T + 1), dtype=np.int64)
        for b in range(self.B):
            off = self.rng.integers(0, len(self.s) - self.T - 1)
            row = self.s[off : off + self.T + 1]
            if self.pool and self.rng.random() < self.cf:
                c = self.pool[self.rng.integers(len(self.pool))][: self.T + 1]
                row = np.concatenate([c, row[: self.T + 1 - len(c)]])
            out[b] = row
        x = torch.from_numpy(out)
        return x[:, :-1], x[:, 1:]


@torch.no_grad()
def target_continuations(
    teacher, stream, n, prompt_len, length, batch, seed
) -> tuple[np.ndarray, float]:
    """Sequence-level distillation data (Kim & Rush 2016): `prompt_len` training tokens followed by the
    target's own greedy continuation, `length` tokens per row.  Speculative decoding accepts a draft
    token only when it equals the target's greedy choice, so these rows show the draft exactly the
    behaviour it is scored on, including the target's habit of falling into repetition loops.
    Returns the (n, length) rows and the seconds spent generating them."""
    rng = np.random.default_rng(seed)
    offs = rng.integers(0, len(stream) - prompt_len - 1, size=n)
    out = np.empty((n, length), dtype=np.int64)
    t0 = time.time()
    for i in tqdm(range(0, n, batch), desc="seq-KD data", mininterval=10, file=sys.stdout):
        x = torch.from_numpy(
            np.stack([stream[o : o + prompt_len] for o in offs[i : i + batch]]).astype(np.int64)
        )
        g = teacher.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=length - prompt_len,
            min_new_tokens=length - prompt_len,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
        out[i : i + len(x)] = g[:, :length].numpy()
    secs = time.time() - t0
    print(f"seq-KD: {n} target continuations in {secs / 60:.1f} min", flush=True)
    return out, secs


class MixBatcher:
    """Replaces a fraction of the rows of another batcher's batches with seq-KD rows."""

    def __init__(self, base: Batcher, rows: np.ndarray, frac: float, seed: int):
        self.base, self.rows, self.frac = base, np.asarray(rows), frac
        self.rng = np.random.default_rng(seed)

    def next(self):
        x, y = self.base.next()
        full = torch.cat([x, y[:, -1:]], dim=1)
        for b in range(full.size(0)):
            if self.rng.random() < self.frac:
                full[b] = torch.from_numpy(self.rows[self.rng.integers(len(self.rows))])
        return full[:, :-1], full[:, 1:]


def fixed_eval_batches(stream, seq_len, n_seqs, batch):
    """Deterministic non-overlapping windows spread over the split."""
    n_avail = (len(stream) - 1) // seq_len
    idx = np.linspace(0, n_avail - 1, num=min(n_seqs, n_avail)).astype(int)
    rows = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int64)
    t = torch.from_numpy(rows)
    return [(t[i : i + batch, :-1], t[i : i + batch, 1:]) for i in range(0, len(t), batch)]


@torch.no_grad()
def eval_loss(model, batches):
    model.eval()
    tot, n = 0.0, 0
    for x, y in batches:
        logits = model(input_ids=x).logits
        tot += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum"
        ).item()
        n += y.numel()
    model.train()
    return tot / n


# ----------------------------------------------------------------------------- saving / plots
def save_model(model, out_dir, tok):
    from transformers import GenerationConfig

    m = copy.deepcopy(model).to(torch.bfloat16)
    m.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, IM_END_ID],
        pad_token_id=PAD_ID,
        do_sample=False,
        max_new_tokens=256,
    )
    m.save_pretrained(out_dir, safe_serialization=True)
    cp = os.path.join(out_dir, "config.json")
    c = json.load(open(cp))
    if (
        c.pop("experts_implementation", None) is not None
    ):  # a training-speed choice, not part of the model
        json.dump(c, open(cp, "w"), indent=2, sort_keys=True)
    tok.save_pretrained(out_dir)
    # re-apply the template/ids into tokenizer_config.json (kept identical to build_corpus output)
    from models.embedded.build_corpus import CHAT_TEMPLATE

    p = os.path.join(out_dir, "tokenizer_config.json")
    cfg = json.load(open(p))
    cfg.update(
        chat_template=CHAT_TEMPLATE,
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=False,
        add_eos_token=False,
    )
    json.dump(cfg, open(p, "w"), indent=2)


def write_log(log):
    json.dump(log, open(LOG_JSON, "w"), indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, name in zip(axes, ["target", "draft"]):
            r = log.get(name)
            if not r:
                ax.set_title(f"{name}: not trained yet")
                continue
            tr = np.asarray(r["train"])
            if len(tr):
                k = max(1, len(tr) // 100)
                sm = np.convolve(tr[:, 1], np.ones(k) / k, mode="valid")
                ax.plot(tr[k - 1 :, 0], sm, label="train CE (smoothed)", lw=1)
            va = np.asarray(r["valid"])
            if len(va):
                ax.plot(va[:, 0], va[:, 1], "o-", label="valid CE", ms=3)
            if r.get("resumed_at_step"):
                ax.axvline(
                    r["resumed_at_step"],
                    color="gray",
                    ls="--",
                    lw=1,
                    label=f"resumed at {r['resumed_at_step']} (new optimiser, see the model card)",
                )
            ax.set_xlabel("step")
            ax.set_ylabel("cross entropy (nats/token)")
            ax.set_title(f"{name} ({r.get('desc', '')})", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(PLOT), exist_ok=True)
        fig.savefig(PLOT, dpi=110)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e, file=sys.stderr)


# ----------------------------------------------------------------------------- training
def per_layer_aux_loss(router_logits, top_k, num_experts):
    """Switch-style load-balancing loss computed PER LAYER and averaged over layers.

    transformers' load_balancing_loss_func pools the counts of all layers before multiplying, so an
    expert that is overloaded in one layer and starved in another looks balanced; on this model that
    left ~40% of the experts of every layer under 1/4 of the uniform share.  Balanced value = top_k.
    """
    tot = 0.0
    for rl in router_logits:
        probs = F.softmax(rl.float(), dim=-1)
        idx = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        f = torch.zeros(num_experts, device=rl.device).scatter_add_(
            0, idx, torch.ones_like(idx, dtype=torch.float)
        )
        f = f / probs.shape[0]
        tot = tot + num_experts * (f * probs.mean(0)).sum()
    return tot / len(router_logits)


class BiasBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al. 2024) plus a temporal-locality term,
    for routers that choose experts on score + ``e_score_correction_bias`` (glm4_moe here).

    **Balance** carries no gradient: after each optimiser step every layer's bias moves by ``rate`` towards
    balance, up for experts chosen less than the mean over the whole step's batch (all sequences: the global
    batch), down for those chosen more. The bias only changes which experts are *chosen*; the gates are the
    unbiased scores, so cross entropy never pays for balance, and since the counts are global a sequence may
    concentrate on the experts of its domain (specialisation).

    **Locality**: -log of the normalised router mass token t puts on the experts token t-1 chose, with a
    per-layer coefficient steered (multiplicatively, ``ctl_rate`` per step) towards a consecutive-token
    overlap of ``sticky_target`` and capped at ``sticky_cap``. This is an explicit training pressure; the
    model card says so. Routing is read from forward hooks on each layer's router, so the checkpoint is a
    plain glm4_moe.
    """

    def __init__(
        self,
        model,
        rate: float,
        sticky_target: float,
        sticky_coef: float,
        sticky_floor: float,
        sticky_cap: float,
        ctl_rate: float = 0.05,
        update: str = "sign",
        max_err: float = 8.0,
        z_coef: float = 0.0,
    ):
        self.routers = [layer.mlp.gate for layer in model.model.layers]
        self.L, self.k = len(self.routers), self.routers[0].top_k
        self.rate, self.ctl_rate, self.update, self.max_err, self.z_coef = (
            rate,
            ctl_rate,
            update,
            max_err,
            z_coef,
        )
        self.sticky_target, self.sticky = sticky_target, [sticky_coef] * self.L
        self.sticky_floor, self.sticky_cap = sticky_floor, sticky_cap
        self.seen: list = [None] * self.L
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))
        self.last: dict = {}

    def _hook(self, i: int):
        def record(module, inputs, output):
            if torch.is_grad_enabled():  # training forward only; evaluation leaves the record alone
                self.seen[i] = (output[0], output[2])  # raw logits (grad), chosen ids

        return record

    def state(self) -> dict:
        return {
            "sticky_coef": list(self.sticky),
            "bias_abs_max": [float(r.e_score_correction_bias.abs().max()) for r in self.routers],
            **self.last,
        }

    def __call__(self, router_logits, batch: int, seq: int) -> torch.Tensor:
        """Locality loss of this step's forward; also updates the biases and the controller (no gradient)."""
        terms, overlaps, mins, below, zs = [], [], [], [], []
        for l, (logits, ids) in enumerate(self.seen):
            E = logits.shape[-1]
            # Router z-loss on the raw logits: nothing else anchors their level (the gates and the locality
            # term are both nearly shift-invariant once sigmoid scores are small), and when they drift far
            # negative every score is ~0 and the bias alone decides, flipping whole experts on and off.
            zs.append((logits.float() ** 2).mean())
            sel = (
                torch.zeros_like(logits, dtype=torch.bool)
                .scatter_(1, ids, True)
                .view(batch, seq, E)
            )
            overlaps.append(float((sel[:, 1:] & sel[:, :-1]).sum(-1).float().mean() / self.k))
            if self.sticky_target > 0:
                s = torch.sigmoid(logits.float()).view(batch, seq, E)
                p = s / s.sum(-1, keepdim=True)
                terms.append(
                    -torch.log((p[:, 1:] * sel[:, :-1].float()).sum(-1).clamp_min(1e-6)).mean()
                )
            with torch.no_grad():
                cnt = torch.bincount(ids.reshape(-1), minlength=E).float()
                mins.append(float(cnt.min() / cnt.mean()))
                below.append(int((cnt < 0.25 * cnt.mean()).sum()))
                err = (cnt.mean() - cnt) / cnt.mean()  # > 0: chosen less than its share of the step
                # sign: DeepSeek-V3's update. proportional: a hog chosen 5x its share moves 4x as fast, so the few
                # experts that every token's saturated sigmoid scores favour are pulled back before the rest starve.
                step = torch.sign(err) if self.update == "sign" else err.clamp(-self.max_err, 1.0)
                self.routers[l].e_score_correction_bias.add_(self.rate * step)
            if self.sticky_target > 0:
                err = (self.sticky_target - overlaps[l]) / self.sticky_target
                self.sticky[l] = float(
                    min(
                        self.sticky_cap,
                        max(self.sticky_floor, self.sticky[l] * math.exp(self.ctl_rate * err)),
                    )
                )
        self.seen = [None] * self.L
        self.last = {
            "overlap": overlaps,
            "min_share_vs_uniform": mins,
            "experts_below_quarter_share": below,
            "router_z": [float(z.detach()) for z in zs],
        }
        loss = self.z_coef * sum(zs) / self.L
        if terms:
            loss = loss + sum(c * t for c, t in zip(self.sticky, terms)) / self.L
        return loss


class RoutingRegulariser:
    """Router losses of the v2 target: global-batch load balancing plus a temporal-locality term.

    **Global-batch balancing** (Qiu et al. 2025, used by Qwen3): the Switch loss E * sum_i f_i * P_i
    with the expert frequencies f_i counted over the *global* batch, i.e. all sequences of the
    optimiser step, instead of each micro-batch (Qwen3 all-reduces f_i over the data-parallel group).
    On one process the optimiser batch is the global batch.  ``window`` > 1 adds the counts of earlier
    steps to emulate a bigger one, but those counts are stale (the router has moved since): with 8
    steps the balance oscillated and left ~40 of 128 experts per layer starved, so the default is 1.
    f is a count, so it carries no gradient; the gradient flows through the mean router
    probabilities P_i.  f is normalised so that perfect balance gives 1 per layer (v1's per-layer loss
    gave top_k).  A selection term (see __call__) balances how often experts clear the top-k
    threshold, which the mean probabilities stop tracking at k/E = 1/16.

    **Temporal locality**: -log(router probability mass that token t puts on the experts token t-1
    selected), per layer.  It asks consecutive tokens to agree on experts when that costs little
    cross entropy.  Its per-layer coefficient is set by a multiplicative controller that aims the
    measured consecutive-token overlap of selected experts at ``sticky_target``: the coefficient grows
    while a layer is below the target and shrinks when above, so the term only pushes as hard as the
    data makes necessary (the logged coefficients show how hard that was).  It yields to balance: while
    a layer has a starved expert its locality coefficient only shrinks.

    **Balance guard**: the balance coefficient of a layer is raised in the same multiplicative way
    (up to 50x) while the least-used expert of that layer's window is below ``guard_share`` of the
    uniform share (the model card requires >= 1/4 for every expert), and relaxes back towards ``coef``
    otherwise; experts below ``guard_share`` also get a revive term, -log of their mean router
    probability, because the Switch gradient on a starved expert's logit is proportional to its tiny
    probability and cannot bring back an expert no token selects.

    Both controllers depend only on the routing of the seeded batches, so a seeded rerun is
    step-exact.  All three pieces only change the loss; the saved checkpoint is a plain qwen2_moe.
    """

    def __init__(
        self,
        n_layers: int,
        num_experts: int,
        top_k: int,
        mode: str,
        coef: float,
        window: int,
        sticky_target: float,
        sticky_coef: float,
        guard_share: float,
        revive_coef: float,
        start_step: int,
        select_coef: float = 0.0,
        sticky_floor: float = 1e-4,
        sticky_yields: bool = True,
        bal_init: float = 0.0,
        rate: float = 0.05,
    ):
        self.L, self.E, self.k, self.mode = n_layers, num_experts, top_k, mode
        self.coef0 = coef
        self.window = max(1, window if mode == "global" else 1)
        self.bal = [max(coef, bal_init)] * n_layers  # per-layer balance coefficients (guarded)
        self.sticky_target, self.sticky = sticky_target, [sticky_coef] * n_layers
        self.guard_share, self.rate, self.revive_coef = guard_share, rate, revive_coef
        self.select_temp = 1.0  # logit units: wide enough that a collapsed router (large logit gaps) still gets gradient
        self.select_coef = select_coef
        self.sticky_floor, self.sticky_yields = sticky_floor, sticky_yields
        # Controllers start after the warm-up: early routing is collapsed (all tokens share a hidden-state
        # direction) and would otherwise wind the coefficients to their bounds before the model has features.
        self.start_step, self.steps = start_step, 0
        self.hist: list[torch.Tensor] = []  # per step: (L, E) routing counts of earlier steps
        self.last: dict = {}

    def state(self) -> dict:
        return {"balance_coef": list(self.bal), "sticky_coef": list(self.sticky), **self.last}

    def __call__(self, router_logits, batch: int, seq: int) -> torch.Tensor:
        E, k = self.E, self.k
        bal_terms, sticky_terms, revive_terms, counts_now, overlaps, mins, n_starved = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        for l, rl in enumerate(router_logits):
            probs = F.softmax(rl.float(), dim=-1)  # (B*T, E)
            idx = torch.topk(probs, k, dim=-1).indices
            cnt = torch.bincount(idx.reshape(-1), minlength=E).float()
            counts_now.append(cnt)
            glob = cnt + sum(h[l] for h in self.hist) if self.hist else cnt
            f = glob / glob.sum() * E  # 1 per expert when balanced
            # Switch term: balances the mean router probabilities.  With k/E = 1/16 and near-flat logits that
            # no longer tracks selection: experts with a mean probability only ~30% below average were chosen
            # < 1/4 as often as average (run 3).  Selection term: a soft count of how often each expert clears
            # the token's top-k threshold (midway between the k-th and (k+1)-th logit, detached), weighted by
            # (f_i - 1) so under-selected experts are pushed up and over-selected ones down where it matters,
            # at the top-k boundary.
            srt = torch.topk(rl.float(), k + 1, dim=-1).values
            thr = (0.5 * (srt[:, k - 1] + srt[:, k])).detach().unsqueeze(-1)
            soft = torch.sigmoid((rl.float() - thr) / self.select_temp).mean(0) * (
                E / k
            )  # ~1 per expert
            sel_term = ((f - 1.0) * soft).sum() / E
            bal_terms.append((f * probs.mean(0)).sum() + self.select_coef * sel_term)
            mins.append(float(glob.min() / glob.mean()))
            n_starved.append(int((glob < self.guard_share * glob.mean()).sum()))
            low = glob < self.guard_share * glob.mean()
            if self.revive_coef > 0 and bool(low.any()):
                # The Switch loss lifts a starved expert only in proportion to its (tiny) probability, so an
                # expert that no token selects stays dead; this pulls its router row towards the tokens.
                revive_terms.append(-torch.log(probs[:, low].clamp_min(1e-9)).mean())
            sel = (
                torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, True).view(batch, seq, E)
            )
            overlaps.append(float((sel[:, 1:] & sel[:, :-1]).sum(-1).float().mean() / k))
            if self.sticky_target > 0:
                p = probs.view(batch, seq, E)
                mass = (p[:, 1:] * sel[:, :-1].float()).sum(-1).clamp_min(1e-6)
                sticky_terms.append(-torch.log(mass).mean())
        loss = sum(c * t for c, t in zip(self.bal, bal_terms)) / self.L
        if sticky_terms:
            loss = loss + sum(c * t for c, t in zip(self.sticky, sticky_terms)) / self.L
        if revive_terms:
            loss = loss + self.revive_coef * sum(revive_terms) / self.L
        # controllers (no gradient): move each layer's coefficients for the next step
        self.steps += 1
        for l in range(self.L if self.steps > self.start_step else 0):
            starved = mins[l] < self.guard_share
            if self.sticky_target > 0:
                # Balance is the hard constraint, locality the soft goal: while a layer has a starved expert its
                # locality coefficient only decays (locality concentrates mass on few experts, which is what
                # starved them), and it grows towards the target overlap only once the layer is balanced.
                err = (self.sticky_target - overlaps[l]) / self.sticky_target
                err = -abs(err) if starved and self.sticky_yields else err
                self.sticky[l] = float(
                    min(10.0, max(self.sticky_floor, self.sticky[l] * math.exp(self.rate * err)))
                )
            if self.guard_share > 0 and len(self.hist) + 1 >= self.window:
                nxt = self.bal[l] * math.exp(self.rate if starved else -self.rate / 4)
                self.bal[l] = float(min(50 * self.coef0, max(self.coef0, nxt)))
        self.hist.append(torch.stack(counts_now).detach())
        if len(self.hist) > self.window - 1:
            self.hist.pop(0)
        self.last = {
            "overlap": overlaps,
            "min_share_vs_uniform": mins,
            "experts_below_guard": n_starved,
            "balance_loss": [float(t.detach()) for t in bal_terms],
            "sticky_loss": [float(t.detach()) for t in sticky_terms],
            "layers_reviving": len(revive_terms),
        }
        return loss


@torch.no_grad()
def calibrate_bias(model, batcher, iters: int, batches: int, rate: float) -> list[dict]:
    """Settle a glm4_moe target's balancing bias after training, with the weights frozen.

    The bias is a statistic, not a weight (DeepSeek-V3 updates it outside the gradient step), so it can be
    re-estimated on training text like a batch-norm statistic: each iteration routes `batches` training
    batches, counts every layer's choices and moves each bias by `rate` x the relative share error (clipped
    to [-1, 1]: one step never flips a whole expert). Returns per-iteration experts under 1/4 of the
    uniform share, per layer, for the log.
    """
    routers = [layer.mlp.gate for layer in model.model.layers]
    E = routers[0].e_score_correction_bias.numel()
    counts = [torch.zeros(E) for _ in routers]
    hooks = [
        r.register_forward_hook(
            lambda mod, inp, out, c=c: c.add_(torch.bincount(out[2].reshape(-1), minlength=E))
        )
        for r, c in zip(routers, counts)
    ]
    history = []
    try:
        for it in tqdm(range(iters + 1), desc="calibrating the balancing bias", file=sys.stdout):
            for c in counts:
                c.zero_()
            for _ in range(batches):
                model(input_ids=batcher.next()[0])
            shares = [c / c.mean() for c in counts]
            history.append(
                {
                    "iteration": it,
                    "experts_below_quarter_share": [int((sh < 0.25).sum()) for sh in shares],
                    "min_share_vs_uniform": [float(sh.min()) for sh in shares],
                }
            )
            if it == iters:
                break
            for r, sh in zip(routers, shares):
                r.e_score_correction_bias.add_(rate * (1.0 - sh).clamp(-1.0, 1.0))
    finally:
        for h in hooks:
            h.remove()
    return history


def lr_at(step, progress, peak, warmup, min_ratio=0.1):
    """Linear warm-up over `warmup` steps, then cosine from peak to min_ratio*peak as progress goes 0->1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, max(0.0, progress))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_one(
    name,
    model,
    args,
    tok,
    batcher,
    valid_batches,
    log,
    out_dir,
    steps,
    minutes,
    peak_lr,
    teacher=None,
    start_step=0,
    regulariser=None,
):
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    rec = log.setdefault(name, {"train": [], "valid": [], "aux": []})
    if start_step:  # resumed: keep the earlier curve up to the checkpoint
        rec["resumed_at_step"] = start_step
        rec["seconds_before_resume"] = rec.get("train_seconds", 0.0)
        for k in ("train", "valid", "aux"):
            rec[k] = [
                r
                for r in rec.get(k, [])
                if r[0] < start_step or (k == "valid" and r[0] <= start_step)
            ]
    else:
        rec.update(train=[], valid=[], aux=[], routing=[])
    warm0 = start_step
    alpha, T = args.distill_alpha, args.distill_temp

    def step_fn(step, progress):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - warm0, progress, peak_lr, args.warmup)
        x, y = batcher.next()
        is_moe = hasattr(model.config, "num_experts")
        out = model(input_ids=x, labels=None, **({"output_router_logits": True} if is_moe else {}))
        logits = out.logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss = ce
        aux = None
        if isinstance(regulariser, BiasBalancer):  # routing read by hooks; balance by bias, no loss
            aux = regulariser(None, x.size(0), x.size(1))
            loss = loss + aux
        elif getattr(out, "router_logits", None) is not None:
            if regulariser is not None:  # v2: global-batch balance + locality, coefficients inside
                aux = regulariser(out.router_logits, x.size(0), x.size(1))
                loss = loss + aux
            else:  # v1 recipes
                if args.balance == "pooled":
                    aux = out.aux_loss
                else:
                    aux = per_layer_aux_loss(
                        out.router_logits,
                        model.config.num_experts_per_tok,
                        model.config.num_experts,
                    )
                loss = loss + model.config.router_aux_loss_coef * aux
        if teacher is not None and alpha > 0:
            with torch.no_grad():
                t_logits = teacher(input_ids=x).logits.float()
            kl = (
                F.kl_div(
                    F.log_softmax(logits / T, -1).reshape(-1, logits.size(-1)),
                    F.log_softmax(t_logits / T, -1).reshape(-1, logits.size(-1)),
                    log_target=True,
                    reduction="batchmean",
                )
                * T
                * T
            )
            loss = (1 - alpha) * ce + alpha * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        return ce.item(), (aux.item() if aux is not None else None)

    t0 = time.time()
    budget = None
    if (
        not steps
    ):  # size the schedule from measured speed; the cosine then follows wall-clock progress
        nb = args.bench_steps
        tb = time.time()
        for s in range(start_step, start_step + nb):
            ce, aux = step_fn(s, 0.0)
            rec["train"].append([s, ce])
        dt = (time.time() - tb) / nb
        budget = minutes * 60
        steps = max(nb + 1, int(budget / (dt * 1.06)))  # ~6% margin for evals/saves
        print(
            f"[{name}] {dt:.3f}s/step ({args.batch_size * args.seq_len / dt:.0f} tok/s) -> ~{steps} steps "
            f"for {minutes} min",
            flush=True,
        )
        start = start_step + nb
    else:
        start = start_step
    rec.update(steps_planned=steps, tokens_per_step=args.batch_size * args.seq_len)
    # with a step count, a resumed run trains `steps` more steps after start_step
    bar = tqdm(
        range(start, 10**9 if budget else start_step + steps),
        desc=name,
        total=steps,
        mininterval=10,
        file=sys.stdout,
    )
    s = start
    for s in bar:
        progress = (time.time() - t0) / budget if budget else (s - start_step) / steps
        last = (
            (progress >= 1.0)
            if budget
            else (s + 1 - start_step == steps or s + 1 == args.stop_after)
        )
        ce, aux = step_fn(s, progress)
        rec["train"].append([s, ce])
        if aux is not None:
            rec["aux"].append([s, aux])
        if regulariser is not None and ((s + 1) % 10 == 0 or last):
            rec.setdefault("routing", []).append([s + 1, regulariser.state()])
        if (s + 1) % args.eval_every == 0 or last:
            v = eval_loss(model, valid_batches)
            rec["valid"].append([s + 1, v])
            if regulariser is not None:
                st = regulariser.state()
                print(
                    f"[{name}] "
                    + " ".join(
                        f"{k} {[round(v, 3) for v in vals]}"
                        for k, vals in st.items()
                        if isinstance(vals, list)
                    ),
                    flush=True,
                )
            bar.set_postfix(
                ce=f"{ce:.3f}", valid=f"{v:.3f}", aux=f"{aux:.3f}" if aux is not None else "-"
            )
            print(
                f"\n[{name}] step {s + 1}/{steps} train_ce {ce:.4f} valid_ce {v:.4f} "
                f"ppl {math.exp(v):.1f} elapsed {(time.time() - t0) / 60:.1f} min",
                flush=True,
            )
        if (s + 1) % args.save_every == 0 or last:
            rec["train_seconds"] = time.time() - t0 + rec.get("seconds_before_resume", 0.0)
            rec["steps_done"] = s + 1
            save_model(model, out_dir, tok)
            write_log(log)
        if last:
            break
    rec["train_seconds"] = time.time() - t0 + rec.get("seconds_before_resume", 0.0)
    rec["steps_done"] = s + 1
    write_log(log)
    return model


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--calibrate-iters",
        type=int,
        default=0,
        help="glm4_moe: after the target trains (or alone with --stage calibrate), re-estimate the "
        "balancing bias on training text for this many iterations, weights frozen (0 = off)",
    )
    ap.add_argument(
        "--calibrate-batches",
        type=int,
        default=8,
        help="training batches routed per calibration iteration",
    )
    ap.add_argument(
        "--calibrate-rate",
        type=float,
        default=0.02,
        help="bias step per unit of relative share error",
    )
    ap.add_argument(
        "--stage",
        choices=["both", "target", "draft", "calibrate"],
        default="both",
        help="train target then draft (both), or only one; 'draft' loads the saved target as teacher",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed for init, batch sampling and chat synthesis"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch.set_num_threads value (2 on an idle 2-core box; use 1 when the CPU is shared: oversubscribed OpenMP barriers made 2 threads 2x slower here)",
    )
    ap.add_argument("--seq-len", type=int, default=256, help="training sequence length in tokens")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per optimiser step")
    ap.add_argument(
        "--bias-rate",
        type=float,
        default=1e-3,
        help="glm4_moe: per-step change of the auxiliary-loss-free balancing bias (DeepSeek-V3's 0.001)",
    )
    ap.add_argument(
        "--bias-update",
        choices=["sign", "proportional"],
        default="sign",
        help="glm4_moe: bias step = rate x sign(share error) (DeepSeek-V3) or rate x relative share error "
        "(clipped to [-8, 1]): over-chosen experts are pulled back in proportion",
    )
    ap.add_argument(
        "--router-z-coef",
        type=float,
        default=0.0,
        help="glm4_moe: coefficient of the router z-loss, mean(logit^2), which keeps sigmoid scores graded",
    )
    ap.add_argument(
        "--sticky-cap", type=float, default=10.0, help="upper bound of the locality coefficient"
    )
    ap.add_argument(
        "--arch",
        choices=["glm4_moe", "qwen2_moe", "qwen3_moe"],
        default="glm4_moe",
        help="target architecture: glm4_moe = v2, the shipped one (DeepSeek-V3-style sigmoid router with "
        "bias balancing, shared expert, fine-grained routed experts; the default); qwen2_moe = the "
        "same shape with a softmax router and a balance loss (tried first, see the model card); "
        "qwen3_moe = v1 (use with --num-experts 64 --moe-intermediate 64 --balance micro)",
    )
    ap.add_argument(
        "--layers", type=int, default=4, help="target decoder layers (every one is a MoE layer)"
    )
    ap.add_argument(
        "--num-experts", type=int, default=128, help="routed experts per MoE layer of the target"
    )
    ap.add_argument(
        "--top-k", type=int, default=8, help="routed experts per token of the MoE target"
    )
    ap.add_argument(
        "--moe-intermediate", type=int, default=32, help="intermediate size of one routed expert"
    )
    ap.add_argument(
        "--shared-intermediate",
        type=int,
        default=256,
        help="intermediate size of the always-on shared expert (glm4_moe: a multiple of --moe-intermediate)",
    )
    ap.add_argument(
        "--experts-impl",
        choices=["grouped_mm", "eager"],
        default="grouped_mm",
        help="transformers experts kernel used while training: grouped_mm runs all experts of a layer in "
        "one grouped matmul (about 1.6x faster per step here than eager's per-expert loop, same "
        "numbers); the checkpoint is the same either way",
    )
    ap.add_argument(
        "--balance",
        choices=["global", "micro", "pooled"],
        default="global",
        help="load balancing: global = Qwen3-style global-batch Switch loss with expert counts over "
        "--balance-window steps of sequences (v2); micro = v1's per-layer Switch loss over each "
        "micro-batch; pooled = transformers' loss with counts pooled over layers (v1's first 200 steps)",
    )
    ap.add_argument(
        "--balance-window",
        type=int,
        default=1,
        help="global balancing: steps whose routing counts form the global batch (x --batch-size sequences). "
        "1 = the whole optimiser batch. Counts of earlier steps are stale (the router has moved since), "
        "and with 8 steps the balance oscillated and left ~40 of 128 experts per layer starved",
    )
    ap.add_argument(
        "--balance-guard",
        type=float,
        default=0.35,
        help="global balancing: raise a layer's balance coefficient while its least-used expert in the "
        "window is below this fraction of the uniform share (0 = fixed coefficient)",
    )
    ap.add_argument(
        "--select-coef",
        type=float,
        default=0.0,
        help="global balancing: weight of the soft top-k selection-balancing term (0 = off; with it on, "
        "layers 1-3 collapsed onto ~8 experts in a 45-step check, so it is off by default)",
    )
    ap.add_argument(
        "--revive-coef",
        type=float,
        default=0.0,
        help="global balancing: coefficient of -log(router probability) of experts under --balance-guard",
    )
    ap.add_argument(
        "--sticky-target",
        type=float,
        default=0.5,
        help="global balancing: consecutive-token overlap of selected experts the locality controller "
        "aims at (0 = no locality term)",
    )
    ap.add_argument(
        "--sticky-coef", type=float, default=0.01, help="initial coefficient of the locality term"
    )
    ap.add_argument(
        "--sticky-floor", type=float, default=1e-4, help="lower bound of the locality coefficient"
    )
    ap.add_argument(
        "--balance-init",
        type=float,
        default=0.0,
        help="starting balance coefficient (e.g. where phase 1 of a resumed run left the guard)",
    )
    ap.add_argument(
        "--sticky-no-yield",
        action="store_true",
        help="let the locality coefficient grow even while a layer has a starved expert (the balance guard "
        "still raises the balance coefficient); by default locality yields to balance",
    )
    ap.add_argument(
        "--stop-after",
        type=int,
        default=0,
        metavar="STEP",
        help="save and stop after this step without shortening the schedule (phase 1 of a resumed run)",
    )
    ap.add_argument(
        "--target-resume",
        type=int,
        default=0,
        metavar="STEP",
        help="continue the target from the checkpoint in models/embedded/target/ saved at STEP "
        "(fresh optimiser, warm-up again; curve kept from train_log.json)",
    )
    ap.add_argument(
        "--aux-coef",
        type=float,
        default=0.1,
        help="router load-balancing loss coefficient (global: floor of the guarded coefficient, loss "
        "normalised to 1 at balance; micro/pooled: v1's loss, top_k at balance)",
    )
    # Step counts by default, so a rerun with the same seed is step-exact (about 40 + 15 min at 1 thread here);
    # 0 switches to the wall-clock budgets below, whose step count depends on the machine's speed.
    ap.add_argument(
        "--target-steps",
        type=int,
        default=800,
        help="target optimiser steps (default 800, about 36 min at 1 thread here; 0 = size from --target-minutes)",
    )
    ap.add_argument(
        "--target-minutes",
        type=float,
        default=42.0,
        help="wall-clock budget for the target when --target-steps is 0",
    )
    ap.add_argument(
        "--draft-steps",
        type=int,
        default=240,
        help="draft optimiser steps (default 240; 0 = size from --draft-minutes)",
    )
    ap.add_argument(
        "--draft-minutes",
        type=float,
        default=18.0,
        help="wall-clock budget for the draft when --draft-steps is 0",
    )
    ap.add_argument(
        "--target-lr", type=float, default=3e-3, help="peak AdamW learning rate of the target"
    )
    ap.add_argument(
        "--draft-lr", type=float, default=4e-3, help="peak AdamW learning rate of the draft"
    )
    ap.add_argument(
        "--warmup", type=int, default=50, help="linear warm-up steps (then cosine to 10%%)"
    )
    ap.add_argument(
        "--weight-decay", type=float, default=0.05, help="AdamW weight decay on matrices"
    )
    ap.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    ap.add_argument(
        "--chat-frac",
        type=float,
        default=0.05,
        help="fraction of training rows that are synthetic chats",
    )
    ap.add_argument(
        "--distill-alpha",
        type=float,
        default=0.7,
        help="draft loss = (1-a)*CE + a*KL(target||draft); 0 disables distillation",
    )
    ap.add_argument(
        "--distill-temp", type=float, default=1.0, help="distillation softmax temperature"
    )
    ap.add_argument(
        "--seqkd-seqs",
        type=int,
        default=0,
        help="draft: number of target greedy continuations generated for sequence-level distillation "
        "(0 = none, as in v1)",
    )
    ap.add_argument(
        "--seqkd-prompt",
        type=int,
        default=32,
        help="draft: training-split prompt tokens of each seq-KD row",
    )
    ap.add_argument(
        "--seqkd-frac",
        type=float,
        default=0.5,
        help="draft: fraction of training rows taken from seq-KD rows",
    )
    ap.add_argument("--seqkd-batch", type=int, default=64, help="draft: prompts generated together")
    ap.add_argument(
        "--eval-every", type=int, default=100, help="steps between validation evaluations"
    )
    ap.add_argument(
        "--valid-seqs", type=int, default=48, help="fixed validation windows used for the curve"
    )
    ap.add_argument("--save-every", type=int, default=200, help="steps between checkpoint saves")
    ap.add_argument(
        "--bench-steps", type=int, default=5, help="steps timed to size a minute budget"
    )
    ap.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw docs/embedded_loss.png from train_log.json and exit",
    )
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.plot_only:
        write_log(json.load(open(LOG_JSON)))
        return

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    sys.path.insert(0, ROOT)
    ensure_corpus()
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    # Token ids of the training split, cached beside the data (git-ignored) for reruns.
    train_ids = load_stream(
        tok, os.path.join(DATA, "train.txt"), cache=os.path.join(HERE, ".cache", "train_ids.npy")
    )
    valid_ids = load_stream(tok, os.path.join(DATA, "valid.txt"))
    stats = json.load(open(os.path.join(HERE, "corpus_stats.json")))
    pool = build_chat_pool(
        tok,
        os.path.join(DATA, "train.txt"),
        4000,
        args.seed,
        stats["documents"]["shakespeare"]["train"],
    )
    valid_batches = fixed_eval_batches(valid_ids, args.seq_len, args.valid_seqs, args.batch_size)
    print(
        f"train tokens {len(train_ids)}  valid tokens {len(valid_ids)}  chat pool {len(pool)}",
        flush=True,
    )
    resume = args.target_resume and args.stage in ("both", "target")
    log = (
        json.load(open(LOG_JSON))
        if os.path.exists(LOG_JSON) and (args.stage != "both" or resume)
        else {}
    )
    if resume and isinstance(
        log.get("target"), dict
    ):  # keep how the earlier phases were run, in order
        t = log["target"]
        t["phases"] = (t.get("phases") or ([t["phase1_argv"]] if t.get("phase1_argv") else [])) + [
            t.get("argv")
        ]
        t["phase1_argv"] = t["phases"][0]
    log["args"] = vars(args)
    log["train_tokens"] = int(len(train_ids))

    tcfg, dcfg = target_config(args), draft_config(args)
    ta, da = active_params(tcfg), active_params(dcfg)
    ratio = da["flops_per_token"] / ta["flops_per_token"]
    print(
        f"active FLOPs/token target {ta['flops_per_token']:,} draft {da['flops_per_token']:,} ratio {ratio:.4f}"
    )
    assert ratio <= 1 / 8, "draft exceeds 1/8 of target active FLOPs"

    if args.stage in ("both", "target"):
        torch.manual_seed(args.seed)
        if resume:
            target = AutoModelForCausalLM.from_pretrained(
                TARGET_DIR, dtype=torch.float32, experts_implementation=args.experts_impl
            )
            target.config.router_aux_loss_coef = args.aux_coef
        else:
            tcfg.experts_implementation = args.experts_impl
            target = AutoModelForCausalLM.from_config(tcfg)
            log["target"] = {}
        n = sum(p.numel() for p in target.parameters())
        log["target"]["desc"] = (
            f"{args.arch} {n / 1e6:.2f}M params, {args.num_experts} experts top-{args.top_k}"
            + (
                f" + shared expert, {args.balance}-batch balancing"
                if args.arch == "qwen2_moe"
                else ""
            )
            + (" + shared expert, aux-loss-free bias balancing" if args.arch == "glm4_moe" else "")
        )
        log["target"]["argv"] = list(argv if argv is not None else sys.argv[1:])
        log["target"]["args"] = vars(
            args
        )  # the model card reads the target's own settings from here
        print(f"target params {n:,}", flush=True)
        reg = None
        if args.arch == "glm4_moe":
            reg = BiasBalancer(
                target,
                args.bias_rate,
                args.sticky_target,
                args.sticky_coef,
                args.sticky_floor,
                args.sticky_cap,
                update=args.bias_update,
                z_coef=args.router_z_coef,
            )
        elif args.balance == "global":
            reg = RoutingRegulariser(
                tcfg.num_hidden_layers,
                tcfg.num_experts,
                tcfg.num_experts_per_tok,
                "global",
                args.aux_coef,
                args.balance_window,
                args.sticky_target,
                args.sticky_coef,
                args.balance_guard,
                args.revive_coef,
                0,
                args.select_coef,
                args.sticky_floor,
                not args.sticky_no_yield,
                args.balance_init,
            )
        train_one(
            "target",
            target,
            args,
            tok,
            Batcher(
                train_ids,
                pool,
                args.seq_len,
                args.batch_size,
                args.chat_frac,
                args.seed + 1 + args.target_resume,
            ),
            valid_batches,
            log,
            TARGET_DIR,
            args.target_steps,
            args.target_minutes,
            args.target_lr,
            start_step=args.target_resume,
            regulariser=reg,
        )
    if args.calibrate_iters and args.stage in ("both", "target", "calibrate"):
        model = (
            target
            if args.stage != "calibrate"
            else AutoModelForCausalLM.from_pretrained(
                TARGET_DIR, dtype=torch.float32, experts_implementation=args.experts_impl
            )
        )
        model.eval()
        hist = calibrate_bias(
            model,
            Batcher(train_ids, pool, args.seq_len, args.batch_size, args.chat_frac, args.seed + 5),
            args.calibrate_iters,
            args.calibrate_batches,
            args.calibrate_rate,
        )
        print(
            f"calibration: experts under 1/4 share per layer {hist[0]['experts_below_quarter_share']} -> "
            f"{hist[-1]['experts_below_quarter_share']}",
            flush=True,
        )
        log.setdefault("target", {})["calibration"] = {
            "argv": list(argv if argv is not None else sys.argv[1:]),
            "iters": args.calibrate_iters,
            "batches": args.calibrate_batches,
            "rate": args.calibrate_rate,
            "history": hist,
        }
        save_model(model, TARGET_DIR, tok)
        write_log(log)
    if args.stage in ("both", "draft"):
        teacher = None
        if args.distill_alpha > 0 or args.seqkd_seqs:
            teacher = AutoModelForCausalLM.from_pretrained(
                TARGET_DIR, dtype=torch.float32, experts_implementation=args.experts_impl
            )
            teacher.config.output_router_logits = False
            teacher.eval()
        batcher = Batcher(
            train_ids, pool, args.seq_len, args.batch_size, args.chat_frac, args.seed + 2
        )
        seqkd_info = None
        if args.seqkd_seqs:
            rows, secs = target_continuations(
                teacher,
                train_ids,
                args.seqkd_seqs,
                args.seqkd_prompt,
                args.seq_len + 1,
                args.seqkd_batch,
                args.seed + 3,
            )
            batcher = MixBatcher(batcher, rows, args.seqkd_frac, args.seed + 4)
            seqkd_info = {
                "sequences": len(rows),
                "prompt_tokens": args.seqkd_prompt,
                "frac": args.seqkd_frac,
                "seconds": secs,
            }
        if args.distill_alpha <= 0:
            teacher = None
        torch.manual_seed(args.seed + 7)
        draft = Qwen3ForCausalLM(dcfg)
        n = sum(p.numel() for p in draft.parameters())
        log["draft"] = {
            "desc": f"dense Qwen3 {n / 1e6:.2f}M params"
            + (", distilled" if teacher else "")
            + (", seq-KD" if seqkd_info else ""),
            "seqkd": seqkd_info,
        }
        log["draft"]["argv"] = list(argv if argv is not None else sys.argv[1:])
        print(f"draft params {n:,}", flush=True)
        train_one(
            "draft",
            draft,
            args,
            tok,
            batcher,
            valid_batches,
            log,
            DRAFT_DIR,
            args.draft_steps,
            args.draft_minutes,
            args.draft_lr,
            teacher=teacher,
        )
    print("done", flush=True)


if __name__ == "__main__":
    main()
