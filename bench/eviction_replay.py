"""How close can an online eviction policy come to Belady's MIN on one recorded decode?

Replays a router trace (engine/offline/trace.py's format; the bigger-than-memory cells save their decode
routing as `trace-*.npz` under their work folder) through each of the project's eviction policies
(policies/: lru, frequency, reuse) with `--slots` fast-tier slots, in the executor's order: each layer's
experts one after another, a miss loading into a free slot or evicting the policy's victim. The first
`--warm` tokens fill the tier and are not counted. Beside each policy: MIN on the same counted accesses
from the same starting residents (engine/offline/belady.py, as the cells report it).

    python -m bench.eviction_replay --trace .cache/bigram/trace-qwen3-30b-a3b-bf16-4.npz --slots 266
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from engine import load_trace, min_loads
from policies.base import EvictionPolicy
from policies.frequency import FrequencyEviction
from policies.lru import LRUEviction
from policies.reuse_distance import ReuseDistanceEviction

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUEviction,
    "frequency": FrequencyEviction,
    "reuse": ReuseDistanceEviction,
}


def accesses(ids: Sequence[Sequence[Sequence[int]]], num_experts: int) -> list[list[list[int]]]:
    """Per token, per layer: the sorted distinct store keys (`layer * num_experts + expert`)."""
    return [
        [sorted({li * num_experts + int(e) for e in layer}) for li, layer in enumerate(token)]
        for token in ids
    ]


def replay(
    keys: list[list[list[int]]], slots: int, policy: EvictionPolicy, warm: int, num_experts: int
) -> tuple[int, set[int]]:
    """Loads `policy` makes in the tokens from `warm` on, and the residents as they start. The policy is
    bound as the store binds it: the layers in forward order and `num_experts` a layer (reuse distance
    reads a key's layer from it)."""
    policy.bind(list(range(len(keys[0]) if keys else 0)), num_experts)
    resident: set[int] = set()
    start: set[int] = set()
    loads = 0
    for t, token in enumerate(keys):
        if t == warm:
            start = set(resident)
        for li, layer_keys in enumerate(token):
            policy.on_layer(li)
            for key in layer_keys:
                if key in resident:
                    policy.on_access(key)
                    continue
                loads += t >= warm
                if len(resident) >= slots:
                    victim = policy.victim(resident)
                    assert victim is not None
                    resident.discard(victim)
                    policy.on_remove(victim)
                resident.add(key)
                policy.on_insert(key)
    return loads, start


def table(keys: list[list[list[int]]], slots: int, warm: int, num_experts: int) -> list[str]:
    counted = keys[warm:]
    seq = [k for token in counted for layer in token for k in layer]
    n = len(counted)
    lines = [
        "| policy | loads / token | MIN from the same residents | policy / MIN |",
        "|---|---|---|---|",
    ]
    for name, make in POLICIES.items():
        loads, start = replay(keys, slots, make(), warm, num_experts)
        best = min_loads(seq, slots, start)
        lines.append(f"| {name} | {loads / n:.2f} | {best / n:.2f} | {loads / max(best, 1):.2f}× |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", type=Path, required=True, help="a router trace (.npz)")
    ap.add_argument("--slots", type=int, required=True, help="fast-tier slots, in experts")
    ap.add_argument(
        "--warm",
        type=int,
        default=16,
        help="tokens that fill the tier before loads are counted (default 16)",
    )
    args = ap.parse_args()
    trace = load_trace(str(args.trace))
    ids = trace["ids"].tolist()
    if args.slots < 1 or not 0 <= args.warm < len(ids):
        ap.error(f"--slots must be >= 1 and --warm below the trace's {len(ids)} tokens")
    num_experts = int(trace["meta"]["num_experts"])
    keys = accesses(ids, num_experts)
    distinct = len({k for t in keys for layer in t for k in layer})
    print(
        f"{args.trace.name}: {len(ids)} tokens, {len(keys[0])} layers, {distinct} distinct experts; "
        f"{args.slots} slots; loads counted from token {args.warm}"
    )
    print("\n".join(table(keys, args.slots, args.warm, num_experts)))


if __name__ == "__main__":
    main()
