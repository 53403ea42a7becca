"""Tests build their tiny checkpoints with models.tiny; re-exported here for short imports."""

from models.tiny import (
    ARCHS,
    CHAT_TEMPLATE,
    NEW_ARCHS,
    config_dict,
    load_reference,
    make_tiny_checkpoint,
    make_tokenizer,
)

__all__ = [
    "ARCHS",
    "NEW_ARCHS",
    "CHAT_TEMPLATE",
    "config_dict",
    "load_reference",
    "make_tiny_checkpoint",
    "make_tokenizer",
]
