"""One engine decode in a process of its own, for benchmarks that measure a whole process: its
memory (peak RSS) or its speed under a memory limit (bench/cgroup.py).

Prints one JSON line: decode tok/s (prefill excluded), the peak RSS of the process, and the RSS
right after loading (before any request).

    python -m bench.engine_once --model DIR --tokens 32 --config '{"dtype": "bfloat16", "offload": "disk"}'
"""

from __future__ import annotations

import argparse
import json
import resource

import torch

from engine import EngineConfig


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True, help="model directory")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument(
        "--config",
        default="{}",
        help="EngineConfig fields as JSON (default: the engine's defaults)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine import SamplingParams, generate, load_model

    om = load_model(args.model, EngineConfig(**json.loads(args.config)))
    loaded = rss_mib()
    prompt = torch.randint(
        3, om.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    r = generate(om, prompt, SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True))
    om.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(
        json.dumps(
            {"tok_s": r.decode_tokens_per_s, "peak_rss_mib": peak, "rss_after_load_mib": loaded}
        )
    )


if __name__ == "__main__":
    main()
