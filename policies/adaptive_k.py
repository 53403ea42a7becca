"""How many tokens to propose for a request's next verification window (pure decision).

Per request it keeps an exponential moving average of the per-token acceptance rate α of its
recent windows. With k proposals and independent acceptances, a window yields on average
(1 - α^(k+1)) / (1 - α) tokens, so a proposal only pays while it is likely to be accepted:
k follows the expected run of accepted tokens, ceil(α / (1 - α)), capped at k_max. When α
falls below `min_rate`, speculation is switched off for the request (k = 0: it decodes
plainly, costing nothing extra) and probed again with k = 1 every `probe_every` steps, so a
request whose text becomes predictable gets speculation back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _State:
    rate: float
    plain_steps: int = 0


@dataclass
class AdaptiveK:
    k_max: int
    adaptive: bool = True
    decay: float = 0.7  # weight of the past in the moving average (about the last 3 windows)
    start_rate: float = 0.6  # optimistic start: the first windows measure the draft
    min_rate: float = 0.25  # below this, speculation costs more than it brings
    probe_every: int = 8  # plain steps between probes of a switched-off request
    _states: dict[str, _State] = field(default_factory=dict)

    def k_for(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k_max
        st = self._states.setdefault(request_id, _State(self.start_rate))
        if st.rate < self.min_rate:
            st.plain_steps += 1
            return 1 if st.plain_steps % self.probe_every == 0 else 0
        return max(1, min(self.k_max, math.ceil(st.rate / max(1e-6, 1.0 - st.rate))))

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A window with `proposed` tokens kept `accepted` of them."""
        if proposed <= 0:
            return
        st = self._states.setdefault(request_id, _State(self.start_rate))
        # A window that stops at the first rejection observes accepted + 1 Bernoulli trials
        # (or `proposed` when all were accepted); its per-token rate estimate:
        trials = min(proposed, accepted + 1)
        st.rate = self.decay * st.rate + (1.0 - self.decay) * (accepted / trials)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
