"""SpecPrefetch in the engine: when layer l routes, predict layer l+1's experts with the router
adapter and start their transfers, so they load while layer l computes.

- Runs on the routing bus, before layer l's experts run; the rows are the whole step's (every
  request's window), so a speculative window predicts the union over its rows.
- The window-aware scheduler (policies/prefetch_window.py) decides what to submit, from the
  predictions, residency, pending transfers, the measured copy time and the measured time
  between consecutive MoE layers. A prediction's confidence is the measured precision of its
  rank (how often the adapter's r-th guess per row was really picked), so the threshold means
  the same thing on every model and workload.
- Predictions never change which experts run: layer l+1's native router still decides, and a
  missed prediction falls back to a demand load. When layer l+1 routes, its queued (not yet
  started) prefetches that it did not pick are cancelled; predicted experts that landed but go
  unused expire and count as wasted (engine/experts/tiers/expert_store.py).
"""

from __future__ import annotations

import time

import torch

from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.experts.cost_meter import CostMeter
from engine.experts.routing_bus import RoutingBus, RoutingEvent, StepContext
from engine.experts.tiers.expert_store import ExpertStore
from engine.experts.tiers.transfers import TransferEngine
from engine.prefetch.adapter import RouterAdapter
from engine.stats import EngineStats
from policies.prefetch_window import PrefetchCandidate, schedule_prefetches

GAP_RATE = 0.1  # moving-average rate of the measured time between consecutive MoE layers
PRECISION_RATE = 0.02  # moving-average rate of the measured precision per prediction rank
MIN_CONFIDENCE = 0.5  # prefetch only what is more likely right than wrong: a wrong one costs a
#                      transfer and an eviction about as much as a right one saves


class AdapterPrefetcher:
    def __init__(
        self,
        adapter: torch.nn.Module,  # a RouterAdapter, or any predictor of its call form
        blocks: dict[int, OffloadedMoeBlock],
        store: ExpertStore,
        transfers: TransferEngine,
        moe_layers: list[int],
        top_k: int,
        meter: CostMeter,
        stats: EngineStats,
    ) -> None:
        self.adapter, self.blocks, self.store, self.transfers = adapter, blocks, store, transfers
        self.moe_layers, self.top_k, self.meter, self.stats = moe_layers, top_k, meter, stats
        self._anchor = {layer: i for i, layer in enumerate(moe_layers[:-1])}
        self._next = dict(zip(moe_layers, moe_layers[1:]))
        # A layer's fair share of the fast tier bounds its prefetches, so predictions for one
        # layer never flush the others.
        self.budget = max(1, store.n_slots // len(moe_layers))
        self._last: tuple[int, float] | None = None  # (layer, time) of the previous routing event
        self.gap_seconds: float | None = None
        # Confidence is calibrated, not the adapter's raw softmax: the measured share of the
        # predictions at each rank (1st .. top_k-th per row) that the next layer really picked.
        self.precision_at_rank = [0.5] * top_k
        self._predicted: dict[
            int, torch.Tensor
        ] = {}  # layer -> [T, top_k] predicted ids, best first
        # Per next layer: the adapter folded with that layer's router into one linear map (W, b),
        # or None where the router's logits are not a linear map (then router + adapter each call).
        self._folded: dict[int, tuple[torch.Tensor, torch.Tensor | None] | None] = {}
        # Deterministic residency (EngineConfig.settle_background, eval's default): every prefetch lands before the
        # next layer plans, by definition, so the scheduler must not weigh measured copy times either, or which
        # experts it prefetches (and the perplexity) would depend on the machine's timing.
        self.settled = False
        # A predictor that runs its own model on the step's tokens (engine/prefetch/draft_predictor.py) starts each
        # forward in `begin_step`; whether it covers the forward's rows.
        self._step: StepContext | None = None
        self._can_predict = True

    def attach(self, bus: RoutingBus) -> None:
        bus.subscribe(self.on_routing)

    def on_routing(self, ev: RoutingEvent) -> None:
        if (
            ev.step is not self._step
        ):  # the forward's first routing event (the runner sets a new context)
            self._step = ev.step
            begin = getattr(self.adapter, "begin_step", None)
            self._can_predict = begin is None or bool(begin(ev.step, ev.x.shape[0]))
        now = time.perf_counter()
        if self._last is not None and self._next.get(self._last[0]) == ev.layer:
            gap = now - self._last[1]
            self.gap_seconds = (
                gap
                if self.gap_seconds is None
                else self.gap_seconds + GAP_RATE * (gap - self.gap_seconds)
            )
        self._last = (ev.layer, now)
        picked = [
            set(row) for row in ev.ids.tolist()
        ]  # per row: the experts this layer really picked
        self._calibrate(ev.layer, picked)
        self._cancel_unpicked(ev.layer, set().union(*picked))
        nxt = self._next.get(ev.layer)
        if nxt is None or not self._can_predict:
            return  # the last MoE layer: the next layer to run is the next step's first
        for e in self._plan(ev, nxt):
            if self.transfers.submit(nxt, e, "prefetch", protect=True) is None:
                break  # no slot can take a prefetch now

    @torch.inference_mode()
    def _plan(self, ev: RoutingEvent, nxt: int) -> list[int]:
        block = self.blocks[nxt]
        x = ev.x.float()
        fate_base = bool(getattr(self.adapter, "fate_base", False))
        if nxt not in self._folded:
            self._folded[nxt] = self._fold(block, ev, fate_base)
        fold = self._folded[nxt]
        if fold is not None:
            pred = torch.nn.functional.linear(x, *fold)
        else:
            base = block.adapter.router_logits(block, ev.x).float() if fate_base else None
            pred = self.adapter(x, self._anchor[ev.layer], base)
        ids = block.adapter.selection_scores(block, pred).topk(self.top_k, dim=-1).indices  # [T, k]
        self._predicted[nxt] = ids
        best: dict[
            int, float
        ] = {}  # a window needs the union of its rows: an expert's best row counts
        for row in ids.tolist():
            for rank, e in enumerate(row):
                best[e] = max(best.get(e, 0.0), self.precision_at_rank[rank])
        E = self.transfers.num_experts
        # Likely picks that are resident already: keep this layer's own prefetches from evicting them.
        self.store.refresh([nxt * E + e for e, c in best.items() if c >= MIN_CONFIDENCE])
        with self.meter.lock:
            copy = 0.0 if self.settled else self.meter.copy_seconds
        return schedule_prefetches(
            [PrefetchCandidate(e, c) for e, c in best.items()],
            lambda e: self.store.state(nxt * E + e) is not None,
            lambda e: self.transfers.in_flight(nxt, e),
            copy_seconds=copy or 0.0,
            workers=self.transfers.workers,
            queued=self.transfers.pending(),
            time_to_next=self.gap_seconds or 0.0,
            budget=self.budget,
            min_confidence=MIN_CONFIDENCE,
        )

    def _fold(
        self, block: OffloadedMoeBlock, ev: RoutingEvent, fate_base: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The predictor for the layer after `ev.layer` as one linear map, where it is one (an
        adapter, on a router whose logits are linear); None: call the predictor each time."""
        if not isinstance(self.adapter, RouterAdapter):
            return None  # another predictor (engine/prefetch/predictors.py): called as a module
        # On the router's device (the adapter is on the model's device too, engine/worker/loader.py).
        lin = block.adapter.router_linear(block, ev.x) if fate_base else (None, None)
        return None if lin is None else self.adapter.folded(self._anchor[ev.layer], *lin)

    def use_predictor(self, predictor: torch.nn.Module) -> None:
        """Predict with another module of the adapter's call form (engine/prefetch/predictors.py:
        FATE, a ProMoE-style network; engine/prefetch/draft_predictor.py: the draft model): the
        baselines measured side by side in bench/seed_003.py. Calibration starts over; the folded
        maps of the old predictor are dropped."""
        self.adapter = predictor
        self._step = None
        self._folded.clear()
        self._predicted.clear()
        self.precision_at_rank = [0.5] * self.top_k

    def _calibrate(self, layer: int, picked: list[set[int]]) -> None:
        """Layer `layer` has routed (`picked`: each row's experts): score what was predicted for
        it, rank by rank. Python sets, not tensor ops: a few rows of top-k ids are cheaper so."""
        pred = self._predicted.pop(layer, None)
        if pred is None or pred.shape[0] != len(picked):
            return
        hits = [0] * len(self.precision_at_rank)
        for row, truth in zip(pred.tolist(), picked):
            for r, e in enumerate(row):
                hits[r] += e in truth
        for r, h in enumerate(hits):
            self.precision_at_rank[r] += PRECISION_RATE * (
                h / len(picked) - self.precision_at_rank[r]
            )

    def _cancel_unpicked(self, layer: int, picked: set[int]) -> None:
        """Layer `layer` has routed: its queued prefetches that it did not pick are wrong now."""
        self.transfers.cancel_queued("prefetch", lambda lay, e: lay == layer and e not in picked)
