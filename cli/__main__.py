"""`python -m cli ...`: the same as the `moe-offload` console script."""

from __future__ import annotations

import sys

from cli.main import main

# Guarded: a spawned child re-imports the main module under another name, and must not run it.
if __name__ == "__main__":
    sys.exit(main())
