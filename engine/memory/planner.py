"""Where each part of a model goes, sized to the machine: the memory plan.

Inputs: the model's Footprint, what the machine has free (machine.py), and the settings. Open
choices (no --cache-fraction / --cache-bytes, --offload auto) are made here (the expert tiers'
in tier_sizing.py):
- the fast tier holds every expert when they fit beside the dense part, the KV reservation,
  the scratch and the headroom; else what is left of the budget;
- the slow tier is host RAM when every expert fits in the host budget, else the checkpoint on disk.
Explicit flags win; a combination that cannot fit raises ConfigError with one line saying what
does not fit and by how much, before anything is allocated (or anything listens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.budget import fmt_bytes, is_fraction, resolve_budget
from engine.config import EngineConfig
from engine.memory.footprint import Footprint, MiB
from engine.memory.machine import HostMemory
from engine.memory.tier_sizing import (
    check_min_slots,
    cpu_tiers,
    gpu_tiers,
    is_explicit,
    room_left,
    short_of,
)

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
    budgets = _budgets(cfg, device, host, device_free)
    fixed = _fixed_pools(fp, cfg, kv_request, budgets)
    # for the fast tier (and, on a CPU, a RAM tier)
    left = room_left(sum(p.nbytes for p in fixed), budgets.fixed, budgets.on_gpu)
    total, slot = fp.total_experts, fp.slot_bytes
    if budgets.on_gpu:
        host_left = budgets.host - _headroom(budgets.host, HOST_HEADROOM_MIN)
        offload, n = gpu_tiers(cfg, total, slot, left, host_left)
    else:
        offload, n = cpu_tiers(cfg, total, slot, left)
    check_min_slots(fp, cfg, n, left, budgets.on_gpu)
    pools = _runtime_pools(runtime_bytes) + fixed
    pools += _tier_pools(fp, cfg, offload, n, budgets.on_gpu)
    pools += _sidecar_pools(sidecar_bytes, sidecar_disk_free)
    return MemoryPlan(
        offload=offload,
        n_slots=int(n),
        total_experts=total,
        slot_bytes=slot,
        device=device,
        host_budget=budgets.host,
        host_source=budgets.host_source,
        device_budget=budgets.device,
        pools=tuple(pools),
    )


@dataclass(frozen=True)
class _Budgets:
    """The budgets a plan fits in: the host's (and what set it) and, computing on CUDA, the device's."""

    on_gpu: bool
    host: int
    host_source: str  # "--host-memory" or what HostMemory measured
    device: int | None  # None on a CPU

    @property
    def where(self) -> str:
        """Where the dense part, the KV cache, the scratch and the fast tier live."""
        return "device" if self.on_gpu else "host"

    @property
    def fixed(self) -> int:
        """The budget the dense part, the KV reservation, the scratch and the headroom come out of."""
        budget = self.device if self.on_gpu else self.host
        assert budget is not None
        return budget

    @property
    def headroom_floor(self) -> int:
        """The least headroom kept out of the `fixed` budget."""
        return DEVICE_HEADROOM_MIN if self.on_gpu else HOST_HEADROOM_MIN


def _budgets(cfg: EngineConfig, device: str, host: HostMemory, device_free: int | None) -> _Budgets:
    """The budgets --host-memory / --device-memory give, else what the machine has free."""
    on_gpu = device.startswith("cuda")
    host_budget = resolve_budget(cfg.host_memory, "--host-memory", host.available)
    host_source = (
        "--host-memory"
        if cfg.host_memory is not None and not is_fraction(cfg.host_memory)
        else host.source
    )
    dev_budget = (
        resolve_budget(cfg.device_memory, "--device-memory", device_free or 0) if on_gpu else None
    )
    return _Budgets(on_gpu, host_budget, host_source, dev_budget)


def _fixed_pools(fp: Footprint, cfg: EngineConfig, req: KvRequest, budgets: _Budgets) -> list[Pool]:
    """The pools taken before the expert tiers, where the model computes: the dense part, the KV
    reservation, the scratch and the headroom."""
    kv, kv_why = kv_reservation(fp, cfg, req)
    where, floor = budgets.where, budgets.headroom_floor
    return [
        Pool("dense", where, fp.dense_bytes, _dense_why(fp)),
        Pool("kv_cache", where, kv, kv_why),
        Pool(
            "scratch",
            where,
            fp.scratch_bytes(),
            "activations of a 1024-token prefill chunk and kernel workspaces (estimate)",
        ),
        Pool(
            "headroom",
            where,
            _headroom(budgets.fixed, floor),
            f"{HEADROOM_SHARE:.0%} of the budget, at least {fmt_bytes(floor)}",
        ),
    ]


def _dense_why(fp: Footprint) -> str:
    """What the dense pool holds, in which dtype, and what of it is elsewhere or smaller."""
    return (
        f"embeddings, attention, norms, routers, shared experts ({fp.dtype})"
        + (
            f"; {fmt_bytes(fp.dense_on_disk_bytes)} of the input embedding stay in the checkpoint, rows read per step"
            if fp.dense_on_disk_bytes
            else ""
        )
        + (
            f"; {fmt_bytes(fp.dense_saved_bytes)} less for linears held as int8 (--dense-quant) or bf16"
            if fp.dense_saved_bytes > 0
            else ""
        )
    )


def _runtime_pools(runtime_bytes: int) -> list[Pool]:
    """The process's own bytes before loading, listed where measured (none where 0)."""
    if not runtime_bytes:
        return []
    return [
        Pool(
            "runtime",
            "host",
            runtime_bytes,
            "this process before loading: Python, torch, transformers (measured; not taken from the budget)",
        )
    ]


def _tier_pools(fp: Footprint, cfg: EngineConfig, offload: str, n: int, on_gpu: bool) -> list[Pool]:
    """The fast tier's pool (`n` slots) and the slow tier's (`offload`: "ram" or "disk")."""
    total, slot = fp.total_experts, fp.slot_bytes
    why_n = _fast_tier_why(cfg, n, total)
    fast_where = "device" if on_gpu else "host"
    if not on_gpu and offload == "ram" and n == total:
        fast = Pool(
            "fast_tier", fast_where, 0, why_n + "; the RAM tier's buffer itself (zero-copy)"
        )
    else:
        fast = Pool("fast_tier", fast_where, n * slot, why_n)
    if offload == "ram":
        slow = Pool(
            "slow_tier",
            "host",
            total * slot,
            "every expert in host RAM: they fit the host budget"
            + (" (pinned, in chunks)" if on_gpu else ""),
        )
    else:
        why = (
            "--offload disk"
            if cfg.offload == "disk"
            else f"every expert ({fmt_bytes(total * slot)}) exceeds the host budget: read from the checkpoint with uncached I/O"
        )
        slow = Pool("slow_tier", "disk", total * fp.expert_disk_bytes, why)
    return [fast, slow]


def _fast_tier_why(cfg: EngineConfig, n: int, total: int) -> str:
    """Why the fast tier holds `n` of `total` experts: a flag, or what the budget allows."""
    share = n / total
    return f"{n} of {total} experts ({share:.0%}): " + (
        "--cache-bytes"
        if cfg.cache_bytes is not None
        else f"--cache-fraction {cfg.cache_fraction}"
        if is_explicit(cfg)
        else "every expert fits"
        if n == total
        else "what the budget leaves after the rows above"
    )


def _sidecar_pools(sidecar_bytes: int, sidecar_disk_free: int | None) -> list[Pool]:
    """The quantized-expert file still to be written (none where 0); raises where the disk lacks room."""
    if not sidecar_bytes:
        return []
    if sidecar_disk_free is not None and sidecar_bytes > sidecar_disk_free:
        raise short_of(
            "the quantized-expert cache file",
            sidecar_bytes,
            sidecar_disk_free,
            "free disk space or set --quant-cache-dir",
        )
    return [
        Pool(
            "quant_sidecar",
            "disk",
            sidecar_bytes,
            "quantized experts written once to --quant-cache-dir",
        )
    ]
