"""One MoE layer of one simulated step: the dense part, the miss policy's plan over the step's rows,
demand loads (joining prefetches in flight), the CPU split, the compute timeline with its stall,
then admissions, expired predictions and the next layer's top-up."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.experts.compute.cpu_split import split_misses
from engine.experts.tiers.residency import INF
from engine.offline.sim_prefetch import PrefetchReplay
from policies.balancer import LayerCosts, choose_tau, fixed_tau
from policies.base import DROPPED, ExpertPlan


class LayerReplay(PrefetchReplay):
    # -- one MoE layer of one step ----------------------------------------------------------
    def _layer(self, li: int, rows: list[int], requests: int) -> None:
        """Replay MoE layer `li` over the step's trace rows `rows` (of `requests` requests)."""
        now = self._layer_start(li, len(rows), requests)
        plan, rows_of, ready = self._plan(li, rows, now)
        on_cpu: list[int] = []
        if plan.fetch and self.s.cpu_experts != "off":
            on_cpu = self._cpu_split(li, plan.fetch, ready, rows_of, now)
        new_loads, joined = self._demand(li, plan.fetch, on_cpu, now, len(rows) > 1)
        landing, cpu_end = self._schedule(li * self.E, new_loads, on_cpu, rows_of, now)
        if joined:
            landing += joined
        end = self._compute(ready, rows_of, landing, on_cpu, cpu_end, now)
        self._account(plan, len(rows))
        self._after_layer(li, rows, plan, end)

    def _layer_start(self, li: int, T: int, requests: int) -> float:
        """When the layer's experts may start: after attention, norms and router (d(rows)), and the
        compute thread's share of the transfers started in the background since the last layer
        (per_load_s: 0 off a CPU-only box). Starts the queued prefetches a worker took meanwhile."""
        dense = self._dense_s.get((T, requests))
        if dense is None:
            dense = self._dense_s[(T, requests)] = self.costs.d(T, requests)
        now = self.clock + dense + self.bg_cpu_s
        self.bg_cpu_s = 0.0
        if self.link.queue:
            self._advance(now)
        self.cache.eviction.on_layer(li)
        return now

    def _plan(
        self, li: int, rows: list[int], now: float
    ) -> tuple[ExpertPlan, dict[int, int], list[int]]:
        """The miss policy's plan over the rows, each needed expert's row count, and the resident
        experts it uses (ascending): pinned for the layer and touched, as the executor does."""
        cache, base, pol = self.cache, li * self.E, self.pol
        get = cache.ready.get

        def is_res(e: int) -> bool:
            return get(base + e, INF) <= now

        ids, weights = self.ids, self.weights
        lg = self.logits  # not None where the policy needs it (checked when built)
        logits = (
            [lg[t, li].tolist() for t in rows] if lg is not None and pol.miss.needs_logits else None
        )
        plan = pol.miss.plan(
            li, [ids[t][li] for t in rows], [weights[t][li] for t in rows], is_res, logits
        )
        if len(rows) == 1:
            rows_of = dict.fromkeys(plan.experts[0], 1)
            rows_of.pop(DROPPED, None)
        else:
            rows_of = Counter(e for row in plan.experts for e in row if e != DROPPED)
        if plan.fetch:
            fetch = set(plan.fetch)
            ready = sorted(
                e for e in rows_of if e not in fetch
            )  # touched in id order, as the executor does
        else:
            ready = sorted(rows_of)
        cache.pin_only([base + e for e in rows_of])
        self.r.prefetch_used += cache.touch_all([base + e for e in ready])
        return plan, rows_of, ready

    def _demand(
        self, li: int, fetch: Sequence[int], on_cpu: list[int], now: float, batched: bool
    ) -> tuple[list[int], list[tuple[float, int]]]:
        """The misses that do not run on the CPU: a prefetch (or admission) in flight is joined, as
        transfers.submit does; a queued one starts now; the rest reserve a slot (if every slot is
        pinned the load still runs: a spill). Returns (loads to start now, (landing, expert) joined)."""
        cache, r, base = self.cache, self.r, li * self.E
        get, protected = cache.ready.get, cache.protected
        new_loads: list[int] = []  # demand transfers to start now, with the CPU experts' reads
        joined: list[tuple[float, int]] = []
        cand: set[int] | None = None
        for e in fetch:
            if on_cpu and e in on_cpu:
                continue
            key = base + e
            t = get(key)
            if t is not None:
                if t == INF:
                    del self.link.queue[key]
                    self.predicted.discard(key)
                    new_loads.append(e)
                else:
                    joined.append((t, e))
                if protected.pop(key, None) is not None:
                    r.prefetch_used += 1
            else:
                if cand is None and batched and not cache.free:
                    cand = cache.evictable_set(now)
                cache.reserve(key, True, now, pin=False, candidates=cand)
                new_loads.append(e)
                r.demand_loads += 1
        return new_loads, joined

    def _compute(
        self,
        ready: list[int],
        rows_of: dict[int, int],
        landing: list[tuple[float, int]],
        on_cpu: list[int],
        cpu_end: float,
        now: float,
    ) -> float:
        """The compute thread's timeline: the resident experts, then each loaded expert as it lands
        (the executor's order), then the CPU results. Charges compute and stall; returns the end."""
        c, r, g = self.costs, self.r, self._g_of
        busy = sum([g(rows_of[e]) for e in ready])
        end, stall = now + busy, 0.0
        if len(landing) > 1:
            landing.sort()
        for t, e in landing:
            if t > end:
                stall += t - end
                end = t
            # A CPU-run expert on a box whose CPU is the fast device: its read overlapped, its
            # compute holds the compute thread (same cores); a copied expert runs on the device.
            run = (
                c.h(rows_of[~e]) if e < 0 else g(rows_of[e])
            ) + c.per_load_s  # every read from the slow tier costs per_load_s
            end += run
            busy += run
        if on_cpu:  # the compute thread collects the CPU results last
            if cpu_end > end:
                stall += cpu_end - end
                end = cpu_end
            r.cpu_expert_calls += len(on_cpu)
        r.compute_s += now - self.clock + busy
        r.stall_s += stall
        self.clock = end
        return end

    def _account(self, plan: ExpertPlan, T: int) -> None:
        """Per-call counters, as the executor's _account."""
        r = self.r
        r.calls += T * self.k
        r.calls_hit += plan.calls_hit
        r.calls_fetched += plan.calls_fetched
        if plan.substituted:
            r.calls_substituted += len(plan.substituted)
            r.substituted_mass += sum(m for _, m in plan.substituted)
        r.token_layers += T

    def _after_layer(self, li: int, rows: list[int], plan: ExpertPlan, end: float) -> None:
        """What follows the layer's compute: background admissions, the predictor's expired
        prefetches, the protection tick, and the top-ups of the next layer."""
        cache, r, base, link = self.cache, self.r, li * self.E, self.link
        cache.pins.clear()
        for e in self.pol.admission.observe(li, plan.substituted):
            # Background: the link and a worker, never the compute clock (after compute, as _admit).
            key = base + e
            if key not in cache.ready and cache.reserve(key, False, end, pin=False) is not None:
                cache.land(key, link.start(end))
                self.bg_cpu_s += self.costs.per_load_s
                r.admissions += 1
        if self.predicted:
            # The predictor's prefetches for this layer that never started missed their window:
            # cancelled (a queued transfer is cancellable, transfers.cancel), counted as cancelled.
            for key in [k for k in self.predicted if base <= k < base + self.E]:
                self.predicted.discard(key)
                if key in link.queue:
                    del link.queue[key]
                    self._cancel(key)
        cache.tick()
        if self.utility is not None and self.s.prefetch == "utility" and self.utility.windows:
            self._top_up((li + 1) % self.L)
        if self.s.predictor is not None and li + 1 < self.L:
            self._predict(rows, li)

    def _cpu_split(
        self, li: int, fetch: Sequence[int], ready: list[int], rows_of: dict[int, int], now: float
    ) -> list[int]:
        """The engine's split (engine/experts/compute/cpu_split.py split_misses), with τ from
        policies.balancer.choose_tau on the profile's costs instead of the engine's online meter."""
        c, base = self.costs, li * self.E
        util = self.utility
        level = (lambda e: util.level(li, e)) if util is not None else (lambda e: 0)

        def cut(ranked: list[int], tau_min: int) -> int:
            cpu_h = c.cpu if not c.cpu_reads_over_link else (c.cpu[0] + c.copy_seconds(), c.cpu[1])
            costs = LayerCosts(
                sum(c.g(rows_of[e]) for e in ready),
                c.copy_seconds(),
                c.fast,
                cpu_h,
                c.transfer_workers,
                c.cpu_workers,
            )
            capacity = self.cache.n_slots - len(
                self.cache.pins
            )  # slots less this layer's pins (the store also leaves out loads in flight)
            if self.s.balancer_level is not None:  # the fixed-threshold ablation
                return fixed_tau(
                    [level(e) for e in ranked], self.s.balancer_level, capacity, tau_min
                )
            return choose_tau([rows_of[e] for e in ranked], costs, capacity, tau_min)

        ranked, tau = split_misses(
            fetch, lambda e: base + e in self.cache.ready, level, rows_of, self.s.cpu_experts, cut
        )
        return ranked[tau:]

    def _schedule(
        self, base: int, loads: list[int], cpu: list[int], rows_of: dict[int, int], now: float
    ) -> tuple[list[tuple[float, int]], float]:
        """Start this layer's demand transfers (transfer workers) and CPU-run experts (CPU workers)
        in time order: whichever pool has a worker free first takes its next job, so both share
        the serial pipe as the engine's threads do. A CPU worker reads its expert (over the link
        on a disk box) and computes it. Returns (landing time, expert) of the loads and the time
        the last CPU expert finishes. Where the CPU is the fast device, a CPU-run expert's compute
        is left to the compute thread: it is returned among the landings as (read done, ~expert)."""
        link, c, free, cache = self.link, self.costs, self.cpu_free_at, self.cache
        landing: list[tuple[float, int]] = []

        def load(e: int) -> None:  # a demand transfer on the first free transfer worker
            t = link.start(now)
            if base + e in cache.ready:
                cache.land(base + e, t)
            landing.append((t, e))

        if not cpu:  # transfers only (the common case): no pool to interleave with
            for e in loads:
                load(e)
            return landing, now
        end, i, j = now, 0, 0
        while i < len(loads) or j < len(cpu):
            tf = max(now, min(link.worker_free_at)) if i < len(loads) else INF
            tc = max(now, min(free)) if j < len(cpu) else INF
            if tf <= tc:
                load(loads[i])
                i += 1
                continue
            e = cpu[j]
            j += 1
            w = free.index(min(free))
            start = max(now, free[w])
            if c.cpu_reads_over_link:
                # The read books the same serial pipe; its latency is waited out on the CPU worker.
                start = max(start, link.pipe_free_at)
                link.pipe_free_at = start + link.bw_s
                start = link.pipe_free_at + link.latency_s
            if c.cpu_is_fast_device:
                free[w] = (
                    start  # the worker is free once read; the compute joins the compute thread's queue
                )
                landing.append((start, ~e))  # ~e: a CPU-run expert (see _layer)
                continue
            free[w] = start + c.h(rows_of[e])
            end = max(end, free[w])
        return landing, end
