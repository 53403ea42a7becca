"""Models this project trains and ships (see models/embedded/README.md)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
EMBEDDED_TARGET = EMBEDDED_DIR / "target"
EMBEDDED_DRAFT = EMBEDDED_DIR / "draft"
# The same pair fine-tuned on 4096-token windows (context 4096), for long generations.
EMBEDDED_LONG_TARGET = EMBEDDED_DIR / "long" / "target"
