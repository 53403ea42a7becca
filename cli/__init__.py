"""The `moe-offload` command line: serve, generate, eval, trace, simulate, plan, train-prefetcher.

Above server/ (HTTP) and engine/ (.importlinter: cli -> server -> engine): the server and the
engine never import it. Entry points: the `moe-offload` console script and `python -m cli`.
"""
