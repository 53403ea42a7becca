"""Saving a trained model with its tokenizer and generation settings; the training log and its plot."""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
import torch

from models.embedded.training.paths import BOS_ID, EOS_ID, IM_END_ID, LOG_JSON, PAD_ID, PLOT


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


def write_log(log, path=LOG_JSON):
    """Write the training log; the main pair's log (LOG_JSON) also redraws its loss curves."""
    json.dump(log, open(path, "w"), indent=2)
    if path != LOG_JSON:
        return
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
