"""Local lm-evaluation-harness tasks on the tiny checkpoints, shared by tests/test_lm_eval.py and
tests/test_lm_eval_exact.py: an EOS-prone checkpoint copy, the documents and task YAML of four task
kinds (multiple choice, loglikelihood, rolling loglikelihood, generation), and the arguments of
lm_eval's "local-completions" backend pointed at one of this project's servers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tiny_models import load_reference
from transformers import AutoTokenizer

MODEL = "tiny"
MAX_LEN = 256
WORDS = "the quick brown fox jumps over lazy dog to be or not that is question hello how are you today fine thank".split()


def eos_prone_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the tiny checkpoint whose EOS logit is 1.05x that of the token the model
    predicts most often, so that many answers are followed by EOS under greedy decoding."""
    shutil.copytree(src, dst)
    shard = dst / "model.safetensors"
    sd = load_file(shard)
    tok = AutoTokenizer.from_pretrained(dst)
    ref = load_reference(src)
    with torch.no_grad():
        ids = tok(" ".join(WORDS))["input_ids"]
        top = ref(torch.tensor([ids])).logits[0].argmax(-1)  # [T]
    common = int(torch.mode(top).values)
    sd["lm_head.weight"][tok.eos_token_id] = sd["lm_head.weight"][common] * 1.05
    save_file(sd, shard, metadata={"format": "pt"})
    return dst


def task_docs(ckpt: Path) -> dict[str, list[dict[str, Any]]]:
    """Small local tasks; the loglikelihood one mixes answers followed by EOS and not."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    ref = load_reference(ckpt)
    eos_next, other = [], []
    for i in range(60):
        ctx = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 4))
        cont = " " + " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(1 + i % 2))
        with torch.no_grad():
            nxt = int(ref(torch.tensor([tok(ctx + cont)["input_ids"]])).logits[0, -1].argmax())
        (eos_next if nxt == tok.eos_token_id else other).append(
            {"context": ctx, "continuation": cont}
        )
    assert len(eos_next) >= 2, "the EOS-prone checkpoint did not make any answer end in EOS"
    ll = eos_next[:4] + other[:4]
    gens = []
    for i in range(6):
        q = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(4))
        ids = tok(q, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = ref.generate(
                ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id
            )
        greedy = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0]
        gens.append({"question": q, "answer": greedy if i % 2 == 0 else "no such answer"})
    return {
        "mc": [
            {
                "question": " ".join(WORDS[i : i + 4]),
                "choices": [" fox", " dog", " hello"],
                "answer": i % 3,
            }
            for i in range(6)
        ],
        "ll": ll,
        "roll": [
            {"text": " ".join(WORDS[(i * 11 + j) % len(WORDS)] for j in range(40 + 30 * i))}
            for i in range(3)
        ],
        "gen": gens,
    }


_YAML = {
    "mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
    "ll": 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\nmetric_list:\n  - metric: perplexity\n  - metric: acc\n',
    "roll": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n',
    "gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n',
}


def write_tasks(ckpt: Path, d: Path, kinds: tuple[str, ...] = tuple(_YAML)) -> list[str]:
    """Write the documents and YAML of `kinds` (of mc, ll, roll, gen) into `d`; their task names."""
    names = []
    for kind, docs in task_docs(ckpt).items():
        if kind not in kinds:
            continue
        data = d / f"{kind}.jsonl"
        data.write_text("".join(json.dumps(x) + "\n" for x in docs))
        name = f"moe_offload_{kind}"
        (d / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{_YAML[kind]}"
        )
        names.append(name)
    return names


def server_model_args(v1: str, ckpt: Path) -> str:
    """lm_eval's "local-completions" model_args for a server at `v1`: token ids on the wire, one
    request at a time, a `MAX_LEN` context."""
    return f"model={MODEL},base_url={v1}/completions,tokenizer_backend=huggingface,tokenizer={ckpt},tokenized_requests=True,num_concurrent=1,max_retries=1,max_length={MAX_LEN}"
