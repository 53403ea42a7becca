"""Where each part of a model goes, sized to the machine: the memory plan.

Inputs: the model's Footprint, what the machine has free (machine.py), and the settings. Open
choices (no --cache-fraction / --cache-bytes, --offload auto) are made here:
- the fast tier holds every expert when they fit beside the dense part, the KV reservation,
  the scratch and the headroom; else what is left of the budget;
- the slow tier is host RAM when every expert fits in the host budget, else the checkpoint on disk.
Explicit flags win; a combination that cannot fit raises ConfigError with one line saying what
does not fit and by how much, before anything is allocated (or anything listens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.budget import fmt_bytes, resolve_budget
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.memory.footprint import Footprint, MiB
from engine.memory.machine import HostMemory

# Where --max-running / --max-model-len are open, the KV reservation covers this many sequences
# of this many tokens each (or of the model's context, if shorter):
DEFAULT_KV_SEQUENCES, DEFAULT_KV_CONTEXT = 4, 8192
HEADROOM_SHARE, HOST_HEADROOM_MIN, DEVICE_HEADROOM_MIN = 0.05, 64 * MiB, 256 * MiB


@dataclass(frozen=True)
class KvRequest:
    """What the KV reservation must cover: `max_model_len` tokens for each of `max_running`
    sequences decoded together (serve's --max-model-len and --max-running). None where the flag
    was left open: the reservation then uses the smaller stated defaults above."""

    max_model_len: int | None = None
    max_running: int | None = None


@dataclass(frozen=True)
class Pool:
    name: str
    where: str  # "device", "host" or "disk"
    nbytes: int
    why: str


@dataclass(frozen=True)
class MemoryPlan:
    offload: str  # the slow tier: "ram" or "disk"
    n_slots: int  # fast-tier slots
    total_experts: int
    slot_bytes: int
    device: str  # "cpu" or "cuda[:N]"
    host_budget: int
    host_source: str
    device_budget: int | None
    pools: tuple[Pool, ...] = field(default_factory=tuple)

    @property
    def zero_copy(self) -> bool:
        """CPU, RAM tier, every expert in the fast tier: the RAM tier's buffer is the fast tier."""
        return self.device == "cpu" and self.offload == "ram" and self.n_slots == self.total_experts

    def planned(self) -> dict[str, int]:
        return {p.name: p.nbytes for p in self.pools}

    def total(self, where: str, budgeted: bool = False) -> int:
        """Planned bytes in `where`; `budgeted`: only what counts against the budget (not the runtime)."""
        return sum(
            p.nbytes
            for p in self.pools
            if p.where == where and not (budgeted and p.name == "runtime")
        )

    def table(self) -> str:
        rows = [("pool", "where", "bytes", "", "why")]
        rows += [(p.name, p.where, str(p.nbytes), fmt_bytes(p.nbytes), p.why) for p in self.pools]
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "memory plan (--device-memory / --host-memory / --max-model-len / --max-running / --cache-fraction / --offload change it):"
        ]
        lines += ["  " + "  ".join(r[i].ljust(w[i]) for i in range(4)) + "  " + r[4] for r in rows]
        budget = f"host budget {fmt_bytes(self.host_budget)} ({self.host_source}), planned {fmt_bytes(self.total('host', budgeted=True))} of it"
        if self.device_budget is not None:
            budget += f"; device budget {fmt_bytes(self.device_budget)}, planned {fmt_bytes(self.total('device'))}"
        lines.append("  " + budget)
        return "\n".join(lines)


def kv_reservation(fp: Footprint, cfg: EngineConfig, req: KvRequest) -> tuple[int, str]:
    """(bytes, why) of the KV cache to reserve: KV per token x context length x sequences, where
    the context length is --max-model-len (at most the model's) and the sequences --max-running,
    each replaced by its stated default when open; --kv-tokens (a total over sequences) wins.
    Sliding-window layers hold at most the window per sequence."""
    per_token = f"{fmt_bytes(fp.kv_bytes_per_token)}/token"
    if fp.sliding_kv_bytes_per_token:
        per_token += f" (+ {fmt_bytes(fp.sliding_kv_bytes_per_token)}/token up to the {fp.sliding_window}-token window)"
    if cfg.kv_tokens is not None:
        tokens = cfg.kv_tokens
        seqs = DEFAULT_KV_SEQUENCES if req.max_running is None else req.max_running
        nbytes = (
            tokens * fp.kv_bytes_per_token
            + min(tokens, seqs * (fp.sliding_window or tokens)) * fp.sliding_kv_bytes_per_token
        )
        return nbytes, f"KV {per_token} x {tokens} tokens (--kv-tokens)"
    (length, len_why), (seqs, seq_why) = _kv_shape(fp, req)
    why = f"KV {per_token} x {length} tokens ({len_why}) x {seqs} sequences ({seq_why})"
    return fp.kv_bytes(length, seqs), why


def _kv_shape(fp: Footprint, req: KvRequest) -> tuple[tuple[int, str], tuple[int, str]]:
    """((tokens per sequence, why), (sequences, why)) the reservation covers without --kv-tokens."""
    if req.max_model_len is not None:
        length = min(req.max_model_len, fp.context)
        len_why = f"--max-model-len {req.max_model_len}" + (
            f", capped at the context {fp.context}" if req.max_model_len > fp.context else ""
        )
    else:
        length = min(fp.context, DEFAULT_KV_CONTEXT)
        len_why = f"--max-model-len open: min(context {fp.context}, {DEFAULT_KV_CONTEXT})"
    if req.max_running is not None:
        return (length, len_why), (req.max_running, "--max-running")
    return (length, len_why), (DEFAULT_KV_SEQUENCES, "--max-running open: default")


def kv_token_budget(fp: Footprint, cfg: EngineConfig, req: KvRequest) -> int:
    """The KV positions the reservation covers, summed over sequences: what the scheduler admits
    requests against (engine/core/scheduler.py), so the KV cache stays inside the plan."""
    if cfg.kv_tokens is not None:
        return cfg.kv_tokens
    (length, _), (seqs, _) = _kv_shape(fp, req)
    return length * seqs


def _headroom(budget: int, floor: int) -> int:
    return max(floor, int(HEADROOM_SHARE * budget))


def _short(what: str, need: int, have: int, hint: str) -> ConfigError:
    return ConfigError(
        f"memory plan: {what} needs {fmt_bytes(need)} but the budget leaves {fmt_bytes(max(0, have))} "
        f"(short by {fmt_bytes(need - max(0, have))}); {hint}"
    )


def plan_memory(
    fp: Footprint,
    cfg: EngineConfig,
    device: str,
    host: HostMemory,
    device_free: int | None = None,
    sidecar_bytes: int = 0,
    sidecar_disk_free: int | None = None,
    runtime_bytes: int = 0,
    kv_request: KvRequest = KvRequest(),
) -> MemoryPlan:
    """The plan for `fp` on this machine. `device_free`: free bytes of the CUDA device (None on CPU);
    `sidecar_bytes`: a quantized-expert file still to be written, checked against `sidecar_disk_free`;
    `runtime_bytes`: what the process holds before loading (Python, torch), already outside the
    measured budget, listed so the plan's host total is comparable with the process's RSS;
    `kv_request`: the context length and sequences the KV reservation covers."""
    on_gpu = device.startswith("cuda")
    host_budget = resolve_budget(cfg.host_memory, "--host-memory", host.available)
    host_source = (
        "--host-memory"
        if cfg.host_memory is not None and not _is_fraction(cfg.host_memory)
        else host.source
    )
    dev_budget = (
        resolve_budget(cfg.device_memory, "--device-memory", device_free or 0) if on_gpu else None
    )
    dense_where = "device" if on_gpu else "host"
    total, slot = fp.total_experts, fp.slot_bytes

    kv, kv_why = kv_reservation(fp, cfg, kv_request)
    scratch = fp.scratch_bytes()
    budget_fixed = dev_budget if on_gpu else host_budget
    assert budget_fixed is not None
    headroom = _headroom(budget_fixed, DEVICE_HEADROOM_MIN if on_gpu else HOST_HEADROOM_MIN)
    fixed = [
        Pool(
            "dense",
            dense_where,
            fp.dense_bytes,
            f"embeddings, attention, norms, routers, shared experts ({str(fp.dtype).removeprefix('torch.')})"
            + (
                f"; {fmt_bytes(fp.dense_on_disk_bytes)} of the input embedding stay in the checkpoint, rows read per step"
                if fp.dense_on_disk_bytes
                else ""
            )
            + (
                f"; {fmt_bytes(fp.dense_saved_bytes)} less for linears held as int8 (--dense-quant) or bf16"
                if fp.dense_saved_bytes > 0
                else ""
            ),
        ),
        Pool("kv_cache", dense_where, kv, kv_why),
        Pool(
            "scratch",
            dense_where,
            scratch,
            "activations of a 1024-token prefill chunk and kernel workspaces (estimate)",
        ),
        Pool(
            "headroom",
            dense_where,
            headroom,
            f"{HEADROOM_SHARE:.0%} of the budget, at least {fmt_bytes(DEVICE_HEADROOM_MIN if on_gpu else HOST_HEADROOM_MIN)}",
        ),
    ]
    fixed_bytes = sum(p.nbytes for p in fixed)
    left = budget_fixed - fixed_bytes  # for the fast tier (and, on a CPU, a RAM tier)
    if left <= 0:
        raise _short(
            "the dense part, KV reservation, scratch and headroom",
            fixed_bytes,
            budget_fixed,
            "raise --device-memory / --host-memory or lower --max-model-len / --max-running / --kv-tokens"
            if on_gpu
            else "raise --host-memory or lower --max-model-len / --max-running / --kv-tokens",
        )
    explicit = cfg.cache_bytes is not None or cfg.cache_fraction is not None
    offload = cfg.offload
    min_slots = min(total, fp.top_k)
    if on_gpu:
        if explicit:
            n = _explicit_slots(cfg, total, slot)
            if n * slot > left:
                raise _short(
                    f"the fast tier ({n} experts)",
                    n * slot,
                    left,
                    "lower --cache-fraction / --cache-bytes or raise --device-memory",
                )
        else:
            n = min(total, left // slot)
        host_left = host_budget - _headroom(host_budget, HOST_HEADROOM_MIN)
        if offload == "auto":
            offload = "ram" if total * slot <= host_left else "disk"
        elif offload == "ram" and total * slot > host_left:
            raise _short(
                "the RAM tier (every expert, pinned)",
                total * slot,
                host_left,
                "use --offload disk or raise --host-memory",
            )
    else:
        all_ram = total * slot
        if explicit:
            n = _explicit_slots(cfg, total, slot)
            ram_need = all_ram + (0 if n == total else n * slot)
            if offload == "auto":
                offload = "ram" if ram_need <= left else "disk"
            need = ram_need if offload == "ram" else n * slot
            if need > left:
                what = (
                    f"the RAM tier and a {n}-expert fast tier"
                    if offload == "ram"
                    else f"the fast tier ({n} experts)"
                )
                raise _short(
                    what,
                    need,
                    left,
                    "lower --cache-fraction / --cache-bytes, use --offload disk, or raise --host-memory",
                )
        elif offload in ("auto", "ram") and all_ram <= left:
            offload, n = "ram", total
        elif offload == "ram":
            raise _short(
                "every expert in RAM",
                all_ram,
                left,
                "use --offload disk (the fast tier is then sized to the budget) or raise --host-memory",
            )
        else:
            offload, n = "disk", min(total, left // slot)
    if (
        n < min_slots and not explicit
    ):  # an explicit size below one token's top-k streams; the planner never picks one
        raise _short(
            f"the fast tier's minimum ({min_slots} experts: one token's top-k)",
            min_slots * slot,
            left,
            "raise --device-memory / --host-memory" if on_gpu else "raise --host-memory",
        )
    share = n / total
    why_n = f"{n} of {total} experts ({share:.0%}): " + (
        "--cache-bytes"
        if cfg.cache_bytes is not None
        else f"--cache-fraction {cfg.cache_fraction}"
        if explicit
        else "every expert fits"
        if n == total
        else "what the budget leaves after the rows above"
    )
    fast_where = "device" if on_gpu else "host"
    pools = (
        [
            Pool(
                "runtime",
                "host",
                runtime_bytes,
                "this process before loading: Python, torch, transformers (measured; not taken from the budget)",
            )
        ]
        if runtime_bytes
        else []
    )
    pools += fixed
    if not on_gpu and offload == "ram" and n == total:
        pools.append(
            Pool("fast_tier", fast_where, 0, why_n + "; the RAM tier's buffer itself (zero-copy)")
        )
    else:
        pools.append(Pool("fast_tier", fast_where, n * slot, why_n))
    if offload == "ram":
        pools.append(
            Pool(
                "slow_tier",
                "host",
                total * slot,
                "every expert in host RAM: they fit the host budget"
                + (" (pinned, in chunks)" if on_gpu else ""),
            )
        )
    else:
        why = (
            "--offload disk"
            if cfg.offload == "disk"
            else f"every expert ({fmt_bytes(total * slot)}) exceeds the host budget: read from the checkpoint with uncached I/O"
        )
        pools.append(Pool("slow_tier", "disk", total * fp.expert_disk_bytes, why))
    if sidecar_bytes:
        if sidecar_disk_free is not None and sidecar_bytes > sidecar_disk_free:
            raise _short(
                "the quantized-expert cache file",
                sidecar_bytes,
                sidecar_disk_free,
                "free disk space or set --quant-cache-dir",
            )
        pools.append(
            Pool(
                "quant_sidecar",
                "disk",
                sidecar_bytes,
                "quantized experts written once to --quant-cache-dir",
            )
        )
    return MemoryPlan(
        offload, int(n), total, slot, device, host_budget, host_source, dev_budget, tuple(pools)
    )


def _is_fraction(text: str) -> bool:
    from engine.budget import parse_budget

    return parse_budget(text, "")[1] is not None


def _explicit_slots(cfg: EngineConfig, total: int, slot_bytes: int) -> int:
    """Fast-tier slots --cache-bytes or --cache-fraction ask for (at least 1, at most every expert)."""
    n = (
        cfg.cache_bytes // slot_bytes
        if cfg.cache_bytes is not None
        else round((cfg.cache_fraction or 1.0) * total)
    )
    return int(min(total, max(1, n)))
