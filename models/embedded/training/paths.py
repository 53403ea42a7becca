"""Where the embedded model's training reads and writes, and the special token ids of its tokenizer."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # models/embedded
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(HERE, "data")
TARGET_DIR = os.path.join(HERE, "target")
DRAFT_DIR = os.path.join(HERE, "draft")
# The long-context pair (training/long_context.py): the pair above, fine-tuned on long windows.
LONG_TARGET_DIR = os.path.join(HERE, "long", "target")
LONG_DRAFT_DIR = os.path.join(HERE, "long", "draft")
LONG_LOG_JSON = os.path.join(HERE, "long", "train_log.json")
LOG_JSON = os.path.join(HERE, "train_log.json")
PLOT = os.path.join(ROOT, "docs", "embedded_loss.png")
DOC_SEP = "\n<|endoftext|>\n"

EOS_ID, BOS_ID, PAD_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3, 4
