"""A layer's plan through its experts when not all of them are resident: resident experts run
while demand loads land, each loaded expert runs as soon as it is present and is unpinned right
after (its slot takes the next load when the layer needs more experts than there are slots),
and CPU-run experts are collected last.

Two shapes of step: one row (plain decode: no grouping) and several rows (prefill, batched
decode, verification windows: rows grouped per expert, each expert over all its rows at once,
the resident ones in one grouped GEMM where the format allows). When every expert a native-row
step needs is resident, all its rows and experts go to the native kernel in one call a layer
(ExpertCompute.resident_rows): the same kernel and order as one row alone, without the Python and
ctypes call per expert that took half of a short prompt's prefill. Either way each row's
contributions are summed in ascending expert order, transformers' order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from engine.experts.compute.cpu_experts import CpuExperts
from engine.experts.compute.expert_compute import ExpertCompute, ExpertFn
from engine.experts.cost_meter import CostMeter
from engine.experts.tiers.expert_store import ExpertLease, ExpertStore
from engine.experts.tiers.transfers import Transfer, TransferEngine
from engine.stats import EngineStats
from policies.base import DROPPED, ExpertPlan


class ExpertLoadError(RuntimeError):
    """An expert could not be loaded; `rows` are the step's rows that needed it."""

    def __init__(self, layer: int, expert: int, cause: BaseException) -> None:
        super().__init__(
            f"expert {expert} of layer {layer} could not be loaded: {type(cause).__name__}: {cause}"
        )
        self.layer, self.expert = layer, expert
        self.rows: list[int] = []


class ExpertStreamer:
    def __init__(
        self,
        compute: ExpertCompute,
        store: ExpertStore,
        transfers: TransferEngine,
        stats: EngineStats,
        expert: ExpertFn,
    ) -> None:
        self.compute, self.store, self.transfers, self.stats = compute, store, transfers, stats
        self.E = compute.num_experts
        self.expert = expert  # one expert over its rows (the executor's, so a test can wrap it)

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        ids_list: list,
        plan: ExpertPlan,
        lease: ExpertLease,
        ready: list[int],
        to_load: list[int],
        on_cpu: list[int],
        weight_rows: list[list[float]],
        meter: CostMeter | None,
        cpu: CpuExperts | None,
    ) -> torch.Tensor:
        """x [T, H] through `plan`: `ready` experts are resident and pinned by `lease`, `to_load` ones are
        loaded on demand, `on_cpu` ones run on `cpu`'s workers. Returns [T, H]."""
        ids, weights, weight_rows = _as_planned(plan, ids, weights, ids_list, weight_rows)
        T, k = ids.shape
        alive = [e for e in plan.experts[0] if e != DROPPED]
        if T == 1 and len(set(alive)) == len(alive):
            return self._single_row(
                layer,
                x,
                plan.experts[0],
                weights=weights,
                lease=lease,
                ready=ready,
                to_load=to_load,
                on_cpu=on_cpu,
                w_list=weight_rows[0],
                meter=meter,
                cpu=cpu,
            )
        if not to_load and not on_cpu and meter is None and self.compute.native_rows(x):
            rows = plan.experts
            if all(DROPPED not in row and len(set(row)) == len(row) for row in rows):
                # Every expert of the step resident: one native call for all rows and experts.
                return self.compute.resident_rows(layer, x, ready, rows, weight_rows)
        flat = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # row-slots grouped by expert
        uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
        groups = dict(zip(uniq.tolist(), torch.split(order, counts.tolist())))
        contrib = torch.empty((T * k, x.shape[1]), dtype=x.dtype, device=x.device)  # [T*k, H]
        if DROPPED in groups:
            contrib[groups.pop(DROPPED)] = 0.0
        w_flat = weights.reshape(-1)
        if len(ready) >= 2 and self.compute.grouped_ok and not self.compute.native_rows(x):
            self._run_grouped(
                layer,
                x,
                groups,
                w_flat=w_flat,
                ready=ready,
                contrib=contrib,
                lease=lease,
                meter=meter,
            )
            ready = []

        def finish(e: int, y: torch.Tensor) -> None:
            rows = groups[e]
            # sigmoid routers' weights are f32: as transformers, cast after
            contrib[rows] = (y * w_flat[rows, None]).to(contrib.dtype)

        self._stream(
            layer,
            lease,
            ready,
            pending=to_load,
            inputs=lambda e: x[groups[e] // k],
            finish=finish,
            on_cpu=on_cpu,
            meter=meter,
            cpu=cpu,
        )
        return _ascending_sum(ids, contrib, T, k)

    def _run_grouped(
        self,
        layer: int,
        x: torch.Tensor,
        groups: dict[int, torch.Tensor],
        *,
        w_flat: torch.Tensor,
        ready: list[int],
        contrib: torch.Tensor,
        lease: ExpertLease,
        meter: CostMeter | None,
    ) -> None:
        """Every resident expert of the step in one batched GEMM per projection (the per-expert Python
        and dispatch cost, not arithmetic, dominates small experts and batched steps), then their pins
        back to `lease`. `contrib` holds T * k rows."""
        k = contrib.shape[0] // x.shape[0]
        t0 = time.perf_counter()
        self.compute.grouped(layer, x, groups, w_flat=w_flat, experts=ready, contrib=contrib, k=k)
        if meter is not None:
            rows_per_expert = round(contrib.shape[0] / len(groups))
            meter.record_fast(rows_per_expert, (time.perf_counter() - t0) / len(ready))
        for e in ready:
            lease.release(layer * self.E + e)

    def _single_row(
        self,
        layer: int,
        x: torch.Tensor,
        experts: Sequence[int],
        weights: torch.Tensor,
        lease: ExpertLease,
        ready: list[int],
        to_load: list[int],
        on_cpu: list[int],
        w_list: list[float],
        meter: CostMeter | None,
        cpu: CpuExperts | None,
    ) -> torch.Tensor:
        """Plain decode (T=1): no grouping needed. The same summation order as the general path; on the
        CPU the experts run through the native kernels (engine/experts/compute/native_moe.py). weights: [1, k]
        (indexed only off the native path: each torch call here runs with a cache the previous
        layer's experts have just flushed); w_list: its row as floats."""
        slot_of = {e: j for j, e in enumerate(experts) if e != DROPPED}
        if not to_load and not on_cpu and meter is None:
            # Every expert resident (cache 1.0, or all hits): nothing to interleave with loads, so
            # no scheduling loop and no early unpinning (the lease unpins all at once on exit).
            # `ready` is in ascending expert order, transformers' summation order.
            return self.compute.resident(
                layer, x, ready, slot_of=slot_of, weights=weights, w_list=w_list, expert=self.expert
            )
        results: dict[int, torch.Tensor] = {}
        row = weights[0]

        def finish(e: int, y: torch.Tensor) -> None:
            results[e] = (y * row[slot_of[e]]).to(y.dtype)

        self._stream(
            layer,
            lease,
            ready,
            pending=to_load,
            inputs=lambda e: x,
            finish=finish,
            on_cpu=on_cpu,
            meter=meter,
            cpu=cpu,
        )
        ordered = [results[e] for e in sorted(results)]
        out = ordered[0].clone()
        for y in ordered[1:]:
            out += y
        return out

    def _stream(
        self,
        layer: int,
        lease: ExpertLease,
        ready: list[int],
        pending: list[int],
        inputs: Callable[[int], torch.Tensor],
        finish: Callable[[int, torch.Tensor], None],
        on_cpu: list[int],
        meter: CostMeter | None,
        cpu: CpuExperts | None,
    ) -> None:
        """Compute every needed expert over its rows `inputs(e)` and hand the result to `finish(e, y)`.

        `ready` experts are resident and pinned by `lease`; `pending` ones are loaded on demand and
        run as soon as they land; `on_cpu` ones are computed by CPU workers from the host tier,
        in parallel, and collected last. Every pin is the lease's, so whatever happens here the
        lease's exit unpins it.
        """
        E = self.E
        assert cpu is not None or not on_cpu
        cpu_jobs = (
            {e: cpu.submit(layer, e, inputs(e)) for e in on_cpu}
            if cpu is not None and on_cpu
            else {}
        )

        def compute(e: int) -> None:
            xe = inputs(e)
            t0 = time.perf_counter()
            y = self.expert(layer * E + e, xe)
            if meter is not None:
                meter.record_fast(xe.shape[0], time.perf_counter() - t0)
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
                        raise RuntimeError(
                            "fast tier deadlock: every slot is pinned and a needed expert cannot load"
                        )
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
        except Exception as e:
            raise ExpertLoadError(layer, expert, e) from e
        finally:
            self.stats.record_stall(time.perf_counter() - t0, layer)
        return y

    def _wait(self, expert: int, t: Transfer) -> None:
        try:
            self.transfers.wait(t)
        except Exception as e:
            raise ExpertLoadError(t.layer, expert, e) from e

    def _submit(
        self,
        layer: int,
        to_load: list[int],
        ready: list[int],
        waiting: dict[int, Transfer],
        lease: ExpertLease,
    ) -> list[int]:
        """Submit demand loads while slots allow; returns the experts still waiting for a slot."""
        E = self.E
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


def _ascending_sum(ids: torch.Tensor, contrib: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """Each row's k contributions (contrib [T*k, H], row-slot order) summed in ascending expert order
    of `ids` [T, k] (transformers' order). Returns [T, H]."""
    perm = torch.argsort(ids, dim=1, stable=True)  # [T, k]
    c = contrib.view(T, k, -1).gather(1, perm.unsqueeze(-1).expand(-1, -1, contrib.shape[1]))
    out = c[:, 0].clone()
    for j in range(1, k):
        out += c[:, j]
    return out


def _as_planned(
    plan: ExpertPlan,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ids_list: list,
    weight_rows: list[list[float]],
) -> tuple[torch.Tensor, torch.Tensor, list[list[float]]]:
    """The routed ids and weights as `plan` changed them (substitutions, dropped experts, new weights)."""
    if plan.experts is not ids_list:
        ids = torch.tensor(plan.experts, dtype=ids.dtype, device=ids.device)
    if plan.weights is not None:
        weights = torch.tensor(plan.weights, dtype=weights.dtype, device=weights.device)
        weight_rows = weights.tolist()  # as rounded to the weights' dtype
    return ids, weights, weight_rows
