"""When speculation pays (seed 000 §15.9–15.10): measured step costs and acceptance history.

Speculating is worth it while the tokens a verify step is expected to commit, divided by what
the step costs, beat the batch size divided by what a plain decode step costs:

    Σ_i (1 + E[accepted_i]) / t_spec(T)   >   B / t_decode(B)

with T the tokens verified (roots plus drafts). Both t_spec and t_decode are measured online,
step by step (wall time of the whole step on the worker: forward, drafting, acceptance), as
an exponential moving average per bucket of token counts, and interpolated in between; a count
never measured is priced like the nearest measured one, so speculation is tried (and then
priced) rather than assumed away. E[accepted_i] comes from each request's acceptance history:
the chance α_i that a draft is accepted given its parent was (successes / trials, decayed), and
E = α + α² + … over the tree's depth. A request whose α falls below MIN_ALPHA stops drafting,
except for a probe every PROBE_INTERVAL steps, so a text that turns repetitive is noticed.
"""

from __future__ import annotations

import bisect
from typing import Any

DECAY = 0.7  # weight of the history in a request's acceptance counts, per verify step
MIN_ALPHA = 0.15
PROBE_INTERVAL = 8
COST_EMA = 0.25  # weight of a new timing in its bucket


class StepCostModel:
    """Seconds per step as a function of the tokens it runs (EMA per power-of-two bucket)."""

    def __init__(self) -> None:
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, seconds)

    def record(self, tokens: int, seconds: float) -> None:
        b = max(tokens, 1).bit_length()
        old = self.points.get(b)
        if old is None:
            self.points[b] = (float(tokens), seconds)
        else:
            self.points[b] = (
                old[0] + COST_EMA * (tokens - old[0]),
                old[1] + COST_EMA * (seconds - old[1]),
            )

    def known(self) -> bool:
        return bool(self.points)

    def cost(self, tokens: int) -> float | None:
        if not self.points:
            return None
        pts = sorted(self.points.values())
        xs = [p[0] for p in pts]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            return pts[-1][1]
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / max(x1 - x0, 1e-9)


class SpecController:
    def __init__(self, max_drafts: int, adaptive: bool = True) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.decode_cost = StepCostModel()
        self.spec_cost = StepCostModel()

    # -- per request --------------------------------------------------------------------------
    def draft_budget(self, req: Any) -> int:
        """How many draft tokens this request proposes this step."""
        if not self.adaptive:
            return self.max_drafts
        st = req.spec
        if st.alpha() >= MIN_ALPHA:
            return self.max_drafts
        st.skipped += 1
        if st.skipped >= PROBE_INTERVAL:
            st.skipped = 0
            return self.max_drafts
        return 0

    @staticmethod
    def expected_accepted(alpha: float, depth: int) -> float:
        return sum(alpha**j for j in range(1, depth + 1))

    # -- per batch ----------------------------------------------------------------------------
    def should_speculate(self, reqs: list[Any], depths: list[int], drafts: int) -> bool:
        """Whether a verify step with these trees (max depths, total drafts) beats plain
        decode for this batch, by the measured costs."""
        if drafts == 0:
            return False
        if not self.adaptive:
            return True
        batch = len(reqs)
        plain = self.decode_cost.cost(batch)
        spec = self.spec_cost.cost(batch + drafts)
        if plain is None:
            return True  # nothing measured yet: speculate, and measure
        if spec is None:
            spec = self.decode_cost.cost(batch + drafts) or plain
        gain = sum(
            1.0 + self.expected_accepted(r.spec.alpha(), d)
            for r, d in zip(reqs, depths, strict=True)
        )
        return gain / spec > batch / plain

    def record_step(self, speculative: bool, tokens: int, seconds: float) -> None:
        (self.spec_cost if speculative else self.decode_cost).record(tokens, seconds)


class RequestSpecState:
    """One request's speculation counters (meta_info's spec_* fields and α)."""

    __slots__ = ("verify_ct", "committed", "drafts", "accepted", "succ", "trials", "skipped")

    def __init__(self) -> None:
        self.verify_ct = 0  # verify steps with at least one draft
        self.committed = 0  # tokens those steps committed (accepted drafts + bonus)
        self.drafts = 0  # draft tokens proposed
        self.accepted = 0  # draft tokens accepted
        self.succ = 1.0  # prior: α = 0.5 until measured
        self.trials = 2.0
        self.skipped = 0

    def alpha(self) -> float:
        return self.succ / self.trials

    def on_verify(self, depth: int, accepted: int, committed: int, drafts: int) -> None:
        """`depth`: the tree's max depth; accepted drafts end at the first rejection (or at the
        tree's end, which is no rejection)."""
        self.verify_ct += 1
        self.committed += committed
        self.drafts += drafts
        self.accepted += accepted
        rejected = 1.0 if accepted < depth else 0.0
        self.succ = DECAY * self.succ + accepted
        self.trials = DECAY * self.trials + accepted + rejected
