"""Errors that reach users as one line naming the file or input and the problem."""

from __future__ import annotations


class MoeOffloadError(Exception):
    """Base class: the message is a complete one-line explanation meant for a user."""


class CheckpointError(MoeOffloadError):
    """A checkpoint directory or file is missing, corrupt, truncated or unsupported."""


class ConfigError(MoeOffloadError):
    """An engine setting is out of range or inconsistent."""
