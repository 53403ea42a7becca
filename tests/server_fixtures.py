"""The tests' servers: the real `moe-offload serve` in a subprocess (bench/serve_process.py)."""

from bench.serve_process import REPO, RunningServer, free_port, serve

__all__ = ["REPO", "RunningServer", "free_port", "serve"]
