"""How many tokens to propose for a request's next verification window (pure decision).

Per request it keeps an exponential moving average of the per-token acceptance rate α of its
recent windows. With k proposals and independent acceptances, a window yields on average
(1 - α^(k+1)) / (1 - α) tokens. What the window costs, relative to a plain decode step, is
1 + k·c + k·v: c is the measured cost of proposing one token (a draft forward; ~0 for the
n-gram proposer) and v the cost of one more verified row in the target's window, both as
fractions of a target step, both measured online (c from the proposer's time, v from the
step times of windows with and without proposals at the same batch size). k is chosen to
maximise tokens per unit of cost; when no k beats plain decoding, k = 0 (the request decodes
plainly, costing nothing extra), and it is probed again with k = 1 every `probe_every` steps
so a request whose text becomes predictable gets speculation back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _State:
    rate: float
    plain_steps: int = 0


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a window of k proposals yields on average (accepted run + the bonus/correction)."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass
class AdaptiveK:
    k_max: int
    adaptive: bool = True
    decay: float = 0.7  # weight of the past in the moving averages (about the last 3 windows)
    start_rate: float = 0.6  # optimistic start: the first windows measure the proposer
    probe_every: int = (
        48  # plain steps between probes of a switched-off request (a probe costs ~2 steps: ~3 %)
    )
    proposal_cost: float = 0.0  # c: one proposed token, as a fraction of a target step (measured)
    # v: one more verified row in the target's window. For an offloaded MoE a row is expensive: it
    # routes to experts the others do not use. Measured on the embedded model (one stream, 1 CPU
    # thread): a 5-row window costs about 2.8 plain steps, so v ≈ 0.44; the default is rounded.
    row_cost: float = 0.4
    _states: dict[str, _State] = field(default_factory=dict)
    # Step time of a plain decode step (no proposals) per batch size, to measure v against. While
    # the current batch size has none, requests decode plainly (one step measures it, and a plain
    # step costs nothing against plain decoding): the row cost differs a lot between a model in
    # memory and one behind a slow link, so the constant above is only a start.
    _plain_step: dict[int, float] = field(default_factory=dict)
    # A plain step's time goes stale once every request speculates (the cache, the machine's load
    # and the text all move): every `refresh_every` speculative steps at a batch size, one step
    # decodes plainly to measure it again (about 3 % of steps; it costs that step's speed-up).
    refresh_every: int = 32
    _since_plain: dict[int, int] = field(default_factory=dict)
    _batch: int = 0  # decode windows in the step being planned (0: unknown, no calibration)
    _measure_plain: bool = False  # this step decodes plainly to (re)measure _plain_step

    def begin_step(self, batch: int) -> None:
        """The proposer is planning a step with `batch` decode windows (0: a step with a prefill)."""
        self._batch = batch
        self._measure_plain = bool(
            self.adaptive
            and batch
            and (
                batch not in self._plain_step
                or self._since_plain.get(batch, 0) >= self.refresh_every
            )
        )

    def observe_step(self, batch: int, extra_rows: int, seconds: float) -> None:
        """A step of `batch` decode windows carried `extra_rows` proposals and took `seconds`."""
        if batch <= 0 or seconds <= 0:
            return
        plain = self._plain_step.get(batch)
        if extra_rows == 0:
            # Down at once, up slowly: the first plain step after a prefill pays for a cold cache
            # (at cache 0.25 with 8 streams, twice a later step), and a baseline that is too slow
            # makes speculation look better than it is.
            self._plain_step[batch] = (
                seconds
                if plain is None or seconds < plain
                else self.decay * plain + (1.0 - self.decay) * seconds
            )
            self._since_plain[batch] = 0
        elif plain is not None:
            self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
            # One more row, as a fraction of one request's share of a plain step.
            v = (seconds - plain) / extra_rows / (plain / batch)
            self.observe_costs(None, min(max(v, 0.0), 5.0))

    def best_k(self, rate: float) -> int:
        best, best_gain = 0, 1.0  # plain decoding: 1 token per unit of cost
        for k in range(1, self.k_max + 1):
            gain = expected_tokens(rate, k) / (1.0 + k * (self.proposal_cost + self.row_cost))
            if gain > best_gain * 1.02:  # a clear win only: noise must not switch speculation on
                best, best_gain = k, gain
        return best

    def k_for(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k_max
        if self._measure_plain:
            return 0  # this step measures plain decoding at this batch size (see _plain_step)
        st = self._states.setdefault(request_id, _State(self.start_rate))
        k = self.best_k(st.rate)
        if k == 0:
            st.plain_steps += 1
            return 1 if st.plain_steps % self.probe_every == 0 else 0
        return k

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A window with `proposed` tokens kept `accepted` of them."""
        if proposed <= 0:
            return
        st = self._states.setdefault(request_id, _State(self.start_rate))
        # A window that stops at the first rejection observes accepted + 1 Bernoulli trials
        # (or `proposed` when all were accepted); its per-token rate estimate:
        trials = min(proposed, accepted + 1)
        st.rate = self.decay * st.rate + (1.0 - self.decay) * (accepted / trials)

    def observe_proposal_time(
        self, batch: int, seconds_per_token: float, step_seconds: float
    ) -> None:
        """Proposing one token for the whole batch took `seconds_per_token`. As a fraction of a
        plain step at this batch size (what the cost model counts in), or of the verification
        step that followed when no plain step is known yet (an underestimate: that step is longer)."""
        base = self._plain_step.get(batch) or step_seconds
        if base > 0:
            self.observe_costs(seconds_per_token / base, None)

    def observe_costs(self, proposal_cost: float | None, row_cost: float | None) -> None:
        """Measured costs (fractions of a plain target step), folded into moving averages."""
        if proposal_cost is not None:
            self.proposal_cost = (
                self.decay * self.proposal_cost + (1.0 - self.decay) * proposal_cost
            )
        if row_cost is not None:
            self.row_cost = self.decay * self.row_cost + (1.0 - self.decay) * row_cost

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
