"""Runs the routed experts of one MoE layer for the T token rows of a step.

Order of work per layer:
1. the policy turns the router's choice into an ExpertPlan (pure decision);
2. resident experts are pinned, missing ones are requested as demand loads;
3. experts run as soon as their weights are present, each over all of its rows at once
   (grouped per expert; no Python loop over tokens), then are unpinned so their slot
   can take the next load when the layer needs more experts than there are slots;
4. each row's contributions are summed in ascending expert order, the same order in
   which transformers' reference accumulates, so the exact policy matches it within float
   rounding: bit for bit through torch's kernels, to the order of each dot product's sum
   through the native CPU kernels (engine/native/; logits within 1e-7-1e-6 in fp32).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from itertools import accumulate
from concurrent.futures import Future

import torch

from engine.weights.expert_layout import ExpertShape
from engine.experts.expert_kernels import SwiGLUKernel
from engine.experts.cost_meter import CostMeter
from engine.experts.cpu_experts import CpuExperts
from engine.experts.expert_store import ExpertLease, ExpertStore
from engine.experts.native_moe import NativeMoe
from engine.experts.quant import ExpertFormat, PlainFormat
from engine.stats import EngineStats
from engine.experts.transfers import Transfer, TransferEngine
from policies.balancer import LayerCosts, choose_tau, rank_misses
from policies.base import DROPPED, AdmissionPolicy, ExpertPlan, MissPolicy
from policies.utility import SpeculativeUtilityEstimator

PROBE_EVERY = 256  # balancer calls between forced CPU runs that keep the CPU cost measurement fresh
GROUPED_MAX_SLOT_BYTES = 256 * 1024  # above this, a slot costs more to gather than a Python call (see _grouped_ok)


class ExpertLoadError(RuntimeError):
    """An expert could not be loaded; `rows` are the step's rows that needed it."""

    def __init__(self, layer: int, expert: int, cause: BaseException) -> None:
        super().__init__(f"expert {expert} of layer {layer} could not be loaded: {type(cause).__name__}: {cause}")
        self.layer, self.expert = layer, expert
        self.rows: list[int] = []


class MoeExecutor:
    def __init__(
        self,
        store: ExpertStore,
        transfers: TransferEngine,
        policy: MissPolicy,
        admission: AdmissionPolicy,
        stats: EngineStats,
        shape: ExpertShape,
        num_experts: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        fmt: ExpertFormat | None = None,
    ) -> None:
        self.store, self.transfers, self.policy, self.stats = store, transfers, policy, stats
        self.admission = admission
        self.shape, self.num_experts = shape, num_experts
        # What an expert computes and how a slot encodes it (engine/experts/quant.py); default: SwiGLU in floats.
        self.fmt = fmt if fmt is not None else PlainFormat(SwiGLUKernel(shape.hidden, shape.intermediate, act_fn), store.slots.dtype)
        # Per-slot weight views, made once: windows onto each contiguous slot ([2I, H] and [H, I] for SwiGLU).
        self._views = [self.fmt.views(row) for row in store.slots]
        # One-token steps on the CPU run their experts in one native call (engine/experts/native_moe.py)
        # from each slot's memory; None where the format or machine does not allow it.
        self._native = NativeMoe.for_format(self.fmt, shape.hidden, shape.intermediate) if store.slots.device.type == "cpu" else None
        self._pointers = [self._native.pointers(v) for v in self._views] if self._native is not None else []
        # The grouped path reads slots as plain [gate | up | down] float matrices: SwiGLU, unquantized,
        # with torch's grouped GEMM (a private op, hence the feature check).
        # It gathers the slots it uses first, which pays only for small experts: a gather copies
        # each expert once more, about 12 us per 100 KB here, against 40-50 us of Python and
        # dispatch per expert in the loop. For the mid peers checkpoint (6.3 MB f32 experts) a
        # 16-token prefill spent about 80 ms per layer gathering, far more than the loop costs.
        self._grouped_ok = (isinstance(self.fmt, PlainFormat) and type(self.fmt.kernel) is SwiGLUKernel
                            and hasattr(torch, "_grouped_mm") and store.slots.dtype in (torch.float32, torch.bfloat16)
                            and self.fmt.slot_bytes <= GROUPED_MAX_SLOT_BYTES)
        # MoE-SpAc (set by the loader when enabled): CPU-run experts, the balancer's cost meter and
        # mode (auto: makespan-optimal split; all: every miss on the CPU, a diagnostic), the utility
        # estimator that ranks misses, and a hook run after each layer (the utility prefetcher's top-up).
        self.cpu: CpuExperts | None = None
        self.cpu_mode = "off"
        self.meter: CostMeter | None = None
        self.utility: SpeculativeUtilityEstimator | None = None
        self.after_layer: Callable[[int], None] | None = None
        self._balancer_calls = 0
        # Deterministic residency (eval): background loads land before each plan, never mid-way.
        self.settle_background = False

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids, weights: [T, k] from the native router, and scores [T, E], what it ranks to
        pick (its logits, or sigmoid + bias), read by policies that choose stand-ins. Returns [T, H]."""
        if ids.shape[0] == 1 and self.store.complete and self._lane_open():
            return self._resident_lane(layer, x, ids, weights)
        E = self.num_experts
        ids_list = ids.tolist()
        weight_rows = weights.tolist()
        logit_rows = scores.tolist() if self.policy.needs_logits else None
        if self.settle_background:
            self.transfers.settle(layer)
        self.store.begin_layer(layer)
        with self.store.lease() as lease:
            # Plan and pin under the store lock: no thread can evict an expert between the
            # policy counting it as a hit (or choosing it as a stand-in) and this layer using it.
            with self.store.lock:
                plan = self.policy.plan(layer, ids_list, weight_rows, lambda e: self.store.is_resident(layer * E + e), logit_rows)
                fetch = set(plan.fetch)
                needed = sorted({e for row in plan.experts for e in row if e != DROPPED})
                if plan.experts is ids_list and not fetch:
                    ready = needed  # the router's own choice, every expert found resident by the plan under this lock
                else:
                    ready = [e for e in needed if e not in fetch and self.store.is_resident(layer * E + e)]
                keys = [layer * E + e for e in ready]
                lease.pin_all(keys)
                self.store.touch_all(keys)
            self.store.tick()
            self.stats.record_lookups(layer, len(ready), len(needed) - len(ready))
            self._account(plan)
            to_load = [e for e in needed if e not in ready]
            on_cpu = self._cpu_split(layer, plan, ready, to_load) if self.cpu is not None and to_load else []
            try:
                out = self._run_plan(layer, x, ids, weights, ids_list, plan, lease, ready,
                                     [e for e in to_load if e not in on_cpu], on_cpu, weight_rows)
            except ExpertLoadError as err:
                # Which rows needed the expert that failed: the runner fails only their requests.
                err.rows = sorted({t for t, row in enumerate(plan.experts) if err.expert in row})
                raise
        if plan.substituted:
            self._admit(layer, plan)  # after compute, so admissions never evict what this layer used
        if self.after_layer is not None:
            self.after_layer(layer)  # this layer's slots are unpinned now: room for the next layer's prefetches
        return out

    def _lane_open(self) -> bool:
        """Whether a one-row step may take the resident lane: nothing that plans around misses is
        attached (CPU experts, the balancer's meter, the utility estimator, a per-layer hook). The
        caller has checked that the store is complete."""
        return self.cpu is None and self.meter is None and self.utility is None and self.after_layer is None

    def _resident_lane(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One decode row when every expert of the model is resident for good (store.complete).

        What run() does there, less what cannot matter: a miss policy decides only about misses
        (policies/base.py), so its plan is the router's choice; no slot can be evicted, so there is
        nothing to pin and no eviction ranking to feed; nothing is prefetched, so no protection
        expires. What is left is the hit counters and the experts' compute, as _run_single_row does
        it: about 90 us of Python a layer less on the tiny peers checkpoint (docs/benchmarks/peers_tiny.md)."""
        row = ids.tolist()[0]  # no select op: [1, k] -> a list
        self.stats.record_all_hits(layer, len(row))
        return self._run_resident(layer, x, sorted(row), {e: j for j, e in enumerate(row)}, weights, weights.tolist()[0])

    def _run_resident(self, layer: int, x: torch.Tensor, ready: list[int], slot_of: dict[int, int], weights: torch.Tensor,
                      w_list: list[float]) -> torch.Tensor:
        """x [1, H] through the resident experts `ready` (ascending: transformers' summation order), each
        scaled by its weight (row slot slot_of[e] of weights [1, k] / its float w_list): one native call
        on the CPU, else a loop of torch calls."""
        E = self.num_experts
        if self._native is not None and ready and self._native.accepts(x):
            return self._native.run(x, [self._pointers[self.store.slot_index(layer * E + e)] for e in ready],
                                    [w_list[slot_of[e]] for e in ready])
        w = weights[0].unbind(0)
        out: torch.Tensor | None = None
        for e in ready:
            y = (self._expert(layer * E + e, x) * w[slot_of[e]]).to(x.dtype)
            out = y if out is None else out.add_(y)
        return out if out is not None else torch.zeros_like(x)  # every expert dropped by the policy

    def _cpu_split(self, layer: int, plan: ExpertPlan, ready: list[int], to_load: list[int]) -> list[int]:
        """The missed experts that run on the CPU, chosen by the workload balancer (policies/balancer.py).

        Ranking: experts already on their way (a prefetch in flight) stay on the fast device;
        the rest hottest first (utility level, then rows in this step)."""
        rows = Counter(e for row in plan.experts for e in row if e != DROPPED)
        level = (lambda e: self.utility.level(layer, e)) if self.utility is not None else (lambda e: 0)
        forced = [e for e in to_load if self.transfers.in_flight(layer, e)] if self.cpu_mode != "all" else []
        ranked = rank_misses(to_load, forced, level, rows)
        tau = len(forced) if self.cpu_mode == "all" else self._choose_tau(ready, ranked, rows, len(forced))
        self.stats.record_balancer(tau, len(ranked))
        return ranked[tau:]

    def _choose_tau(self, ready: list[int], ranked: list[int], rows: Counter, tau_min: int) -> int:
        assert self.meter is not None and self.cpu is not None
        M = len(ranked)
        self._balancer_calls += 1
        with self.meter.lock:
            fast, cpu, copy = self.meter.fast.coefficients(), self.meter.cpu.coefficients(), self.meter.copy_seconds
        if cpu is None or self._balancer_calls % PROBE_EVERY == 0:
            return max(tau_min, M - 1)  # explore: measure (again) what one expert costs on the CPU
        if fast is None or copy is None:
            return M  # nothing copied or computed yet: the fast path's cost is unknown, keep it
        g0, g1 = fast
        costs = LayerCosts(sum(g0 + g1 * rows[e] for e in ready), copy, fast, cpu, self.transfers.workers, self.cpu.workers)
        return choose_tau([rows[e] for e in ranked], costs, self.store.free_or_evictable(), tau_min)

    def _run_plan(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_list: list, plan: ExpertPlan,
                  lease: ExpertLease, ready: list[int], to_load: list[int], on_cpu: list[int],
                  weight_rows: list[list[float]]) -> torch.Tensor:
        E = self.num_experts
        if plan.experts is not ids_list:
            ids = torch.tensor(plan.experts, dtype=ids.dtype, device=ids.device)
        if plan.weights is not None:
            weights = torch.tensor(plan.weights, dtype=weights.dtype, device=weights.device)
            weight_rows = weights.tolist()  # as rounded to the weights' dtype

        T, k = ids.shape
        alive = [e for e in plan.experts[0] if e != DROPPED]
        if T == 1 and len(set(alive)) == len(alive):
            return self._run_single_row(layer, x, plan.experts[0], weights, lease, ready, to_load, on_cpu, weight_rows[0])
        flat = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # row-slots grouped by expert
        uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
        groups = dict(zip(uniq.tolist(), torch.split(order, counts.tolist())))
        contrib = torch.empty((T * k, x.shape[1]), dtype=x.dtype, device=x.device)  # [T*k, H]
        if DROPPED in groups:
            contrib[groups.pop(DROPPED)] = 0.0
        w_flat = weights.reshape(-1)
        if len(ready) >= 2 and self._grouped_ok:
            # Every resident expert of the step in one batched GEMM per projection: the per-expert
            # Python and dispatch cost, not arithmetic, dominates small experts and batched steps.
            t0 = time.perf_counter()
            self._run_grouped(layer, x, groups, w_flat, ready, contrib, k)
            if self.meter is not None:
                self.meter.record_fast(round(len(flat) / len(groups)), (time.perf_counter() - t0) / len(ready))
            for e in ready:
                lease.release(layer * E + e)
            ready = []

        def finish(e: int, y: torch.Tensor) -> None:
            rows = groups[e]
            contrib[rows] = (y * w_flat[rows, None]).to(contrib.dtype)  # sigmoid routers' weights are f32: as transformers, cast after

        self._run_experts(layer, lease, ready, to_load, lambda e: x[groups[e] // k], finish, on_cpu)
        # Sum each row's k contributions in ascending expert order (transformers' order).
        perm = torch.argsort(ids, dim=1, stable=True)  # [T, k]
        c = contrib.view(T, k, -1).gather(1, perm.unsqueeze(-1).expand(-1, -1, contrib.shape[1]))
        out = c[:, 0].clone()
        for j in range(1, k):
            out += c[:, j]
        return out

    def _run_grouped(self, layer: int, x: torch.Tensor, groups: dict[int, torch.Tensor], w_flat: torch.Tensor,
                     experts: list[int], contrib: torch.Tensor, k: int) -> None:
        """SwiGLU of the resident `experts` (ascending) over all their rows: one grouped GEMM per
        projection over just the slots this step uses, gathered from the slot pool (one group per
        expert). groups[e]: the flat row-slot indices routed to e.

        Why gather: torch._grouped_mm costs time per group even when a group is empty, so a
        GEMM straight over the whole pool (512 slots at cache 1.0) cost about 1.3 ms per layer
        whatever the rows; copying the 8-60 slots a step needs costs a fraction of that. The
        arithmetic per row is the same kernel either way, so results are bit-identical. Group
        sizes and slot ids are host lists: on a GPU, no sync per group."""
        H, I = x.shape[1], self.shape.intermediate
        E = self.num_experts
        slots = torch.tensor([self.store.slot_index(layer * E + e) for e in experts], dtype=torch.long, device=x.device)
        rows = torch.cat([groups[e] for e in experts])  # flat row-slot indices, grouped by expert
        offs = torch.tensor(list(accumulate(len(groups[e]) for e in experts)), dtype=torch.int32, device=x.device)  # [G]
        pool = self.store.slots.index_select(0, slots)  # [G, 3*I*H]: [gate | up] rows, then down, per slot
        G = len(experts)
        gate_up = pool[:, : 2 * I * H].view(G, 2 * I, H).transpose(1, 2)  # [G, H, 2I]
        down = pool[:, 2 * I * H :].view(G, H, I).transpose(1, 2)  # [G, I, H]
        gate, up = torch._grouped_mm(x[torch.div(rows, k, rounding_mode="floor")], gate_up, offs=offs).chunk(2, dim=-1)  # [M, I]
        y = torch._grouped_mm(self.fmt.kernel.act_fn(gate) * up, down, offs=offs)  # [M, H]
        contrib[rows] = (y * w_flat[rows, None]).to(contrib.dtype)

    def _run_single_row(self, layer: int, x: torch.Tensor, experts: list[int], weights: torch.Tensor,
                        lease: ExpertLease, ready: list[int], to_load: list[int], on_cpu: list[int],
                        w_list: list[float]) -> torch.Tensor:
        """Plain decode (T=1): no grouping needed. The same summation order as the general path; on the
        CPU the experts run through the native kernels (engine/experts/native_moe.py). weights: [1, k]
        (indexed only off the native path: each torch call here runs with a cache the previous
        layer's experts have just flushed); w_list: its row as floats."""
        slot_of = {e: j for j, e in enumerate(experts) if e != DROPPED}
        if not to_load and not on_cpu and self.meter is None:
            # Every expert resident (cache 1.0, or all hits): nothing to interleave with loads, so
            # no scheduling loop and no early unpinning (the lease unpins all at once on exit).
            # `ready` is in ascending expert order, transformers' summation order.
            return self._run_resident(layer, x, ready, slot_of, weights, w_list)
        results: dict[int, torch.Tensor] = {}
        row = weights[0]

        def finish(e: int, y: torch.Tensor) -> None:
            results[e] = (y * row[slot_of[e]]).to(y.dtype)

        self._run_experts(layer, lease, ready, to_load, lambda e: x, finish, on_cpu)
        ordered = [results[e] for e in sorted(results)]
        out = ordered[0].clone()
        for y in ordered[1:]:
            out += y
        return out

    def _run_experts(self, layer: int, lease: ExpertLease, ready: list[int], pending: list[int],
                     inputs: Callable[[int], torch.Tensor], finish: Callable[[int, torch.Tensor], None], on_cpu: list[int]) -> None:
        """Compute every needed expert over its rows `inputs(e)` and hand the result to `finish(e, y)`.

        `ready` experts are resident and pinned by `lease`; `pending` ones are loaded on demand and
        run as soon as they land; `on_cpu` ones are computed by CPU workers from the host tier,
        in parallel, and collected last. Every pin is the lease's, so whatever happens here the
        lease's exit unpins it.
        """
        E = self.num_experts
        assert self.cpu is not None or not on_cpu
        cpu_jobs = {e: self.cpu.submit(layer, e, inputs(e)) for e in on_cpu} if on_cpu else {}

        def compute(e: int) -> None:
            xe = inputs(e)
            t0 = time.perf_counter()
            y = self._expert(layer * E + e, xe)
            if self.meter is not None:
                self.meter.record_fast(xe.shape[0], time.perf_counter() - t0)
            finish(e, y)

        ready = list(ready)
        waiting: dict[int, Transfer] = {}
        while ready or waiting or pending:
            pending = self._submit(layer, pending, ready, waiting, lease)
            if not ready:
                if not waiting:
                    # Every slot is pinned. Loads started by other threads (prefetch, admission)
                    # free their slots when they land; if none is in flight, nothing ever will.
                    if not self.transfers.wait_for_any_landing(layer=layer):
                        raise RuntimeError("fast tier deadlock: every slot is pinned and a needed expert cannot load")
                    continue
                e = next(iter(waiting))  # oldest submitted first
                self._wait(e, waiting.pop(e))
                ready.append(e)
            e = ready.pop(0)
            compute(e)
            lease.release(layer * E + e)  # frees the slot for the next load if the layer needs more
            for e2 in [e2 for e2, t in waiting.items() if t.done.is_set()]:
                self._wait(e2, waiting.pop(e2))
                ready.append(e2)
        for e, job in cpu_jobs.items():
            finish(e, self._cpu_result(layer, e, job))

    def _cpu_result(self, layer: int, expert: int, job: Future) -> torch.Tensor:
        """A CPU worker's result; the compute thread's wait for it is stall, as for a load."""
        t0 = time.perf_counter()
        try:
            y = job.result()
        except Exception as e:  # noqa: BLE001 - any read failure becomes one clear error
            raise ExpertLoadError(layer, expert, e) from e
        finally:
            self.stats.record_stall(time.perf_counter() - t0, layer)
        return y

    def _wait(self, expert: int, t: Transfer) -> None:
        try:
            self.transfers.wait(t)
        except Exception as e:  # noqa: BLE001 - any read failure becomes one clear error
            raise ExpertLoadError(t.layer, expert, e) from e

    def _account(self, plan: ExpertPlan) -> None:
        """Per-call counters: hit, fetched, substituted, and the substituted gate mass."""
        self.stats.add(calls_hit=plan.calls_hit, calls_fetched=plan.calls_fetched,
                       substitutions=len(plan.substituted), substituted_mass=sum(m for _, m in plan.substituted))

    def _admit(self, layer: int, plan: ExpertPlan) -> None:
        """Background admission of experts that keep being substituted."""
        admitted = 0
        for e in self.admission.observe(layer, plan.substituted):
            # Asynchronous: queued behind demand loads; compute never waits for it.
            if self.transfers.submit(layer, e, "admission") is not None:
                admitted += 1
        if admitted:
            self.stats.add(admissions=admitted)

    def _submit(self, layer: int, to_load: list[int], ready: list[int], waiting: dict[int, Transfer], lease: ExpertLease) -> list[int]:
        """Submit demand loads while slots allow; returns the experts still waiting for a slot."""
        E = self.num_experts
        for i, e in enumerate(to_load):
            key = layer * E + e
            with self.store.lock:
                t = self.transfers.submit(layer, e, "demand", pin=True)
                if t is not None:
                    lease.adopt(key)  # submit(pin=True) pinned it for us
                elif self.store.is_resident(key):  # it landed meanwhile (e.g. a prefetch)
                    lease.pin(key)
                    self.store.touch(key)
                    ready.append(e)
                    continue
            if t is None:
                return to_load[i:]  # every slot is pinned; retry after computing something
            waiting[e] = t
        return []

    def _expert(self, key: int, x: torch.Tensor) -> torch.Tensor:
        """One expert over its rows x [n, H] -> [n, H], unscaled (dequantizing its slot first if quantized)."""
        slot = self.store.slot_index(key)
        if self._native is not None and self._native.accepts(x):
            return self._native.run(x, [self._pointers[slot]], [1.0])
        return self.fmt.forward(self._views[slot], x)
