"""How much to speculate (seed 000 §15.9–15.10): measured step costs and acceptance history.

A step that verifies T tokens (every request's root plus its draft nodes) costs t(T), the
target's forward over T tokens, plus, for a draft model, its k draft forwards. Request i then
commits 1 + E_i tokens in expectation, where E_i = α_i + α_i² + … up to the depth its tree
keeps, and α_i is the chance that its next draft is accepted given its parent was. Plain
decode commits one token per request for t(B). The controller keeps tree levels, and none at
all when plain decode is better (`select`):
* while requests wait for a place in the batch, those that raise the step's expected tokens
  per second (Σ (1 + E_i) / cost): finishing sooner makes room for the next request;
* otherwise those that bring the last running request's finish closer (its remaining tokens
  over 1 + E_i, times the step's cost): a step is as long for every request in it, so drafts
  for some are paid by all, and a batch of requests that speculate unevenly must not end
  later than it would have plainly (measured: 32 clients at once were 13% slower with
  per-step tokens per second as the only rule). Where a request has no end but EOS (no
  max_tokens), the batch's end is unknown: tokens per second again.

Both inputs are measured, never assumed:
* t(T) is the wall time of the target forwards the engine runs (plain decode and verify steps
  are the same forward for the model), the median of the last COST_SAMPLES per power-of-two
  bucket of token counts, interpolated in between. A bucket not measured in the last
  STALE_STEPS forwards is forgotten: only steps of its own kind measure it, so one slow step
  (a first call's warm-up, a pause) priced it for good, and speculation stayed on with every
  draft rejected, or off with every draft accepted. Up to twice the largest count measured it is
  extrapolated from the last two buckets (flat while only one is known); further out it grows
  in proportion to the tokens, which no forward exceeds. So larger steps are explored by
  doublings, each priced before the next: a slope measured at 1-8 tokens once priced a
  68-token verify of 32 requests as almost free. Draft forwards are timed the same way.
* α_i counts, with decay, accepted drafts against first rejections. NGRAM proposals are also
  checked against the tokens a request actually produces while it decodes without speculating
  (a shadow verification), so a text that turns repetitive is noticed within a few tokens.
  A proposal costs ≈ 50 µs, so after an empty proposal or a shadow rejected at its first
  draft the request waits 1, 2, 4, then at most MAX_SHADOW_WAIT plain steps before the next
  (32 requests on random text otherwise proposed ≈ 21 times a step); an accepted draft resets
  the wait. A draft model's request that stopped drafting drafts again every PROBE_INTERVAL
  steps instead.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from collections import deque
from typing import Any

from radixserve.speculative.spec_info import DraftTree

DECAY = 0.8  # weight of the history in a request's acceptance counts, per observation
PROBE_INTERVAL = 16
MAX_SHADOW_WAIT = 8  # the longest wait, in plain steps, between shadow proposals
COST_SAMPLES = 5  # the timings per bucket whose median prices it
STALE_STEPS = 64  # forwards after which a bucket not measured again is forgotten


class StepCostModel:
    """Seconds per forward as a function of the tokens it runs: per power-of-two bucket, the
    median of its last COST_SAMPLES timings (one outlier among them moves nothing)."""

    def __init__(self) -> None:
        self.samples: dict[int, deque[tuple[int, float]]] = {}  # bucket -> (tokens, seconds)
        self.measured_at: dict[int, int] = {}  # bucket -> the clock at its last timing
        self.points: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, seconds)
        self._sorted: list[tuple[float, float]] = []  # points by tokens
        self._xs: list[float] = []

    def record(self, tokens: int, seconds: float, now: int = 0) -> None:
        b = max(tokens, 1).bit_length()
        window = self.samples.setdefault(b, deque(maxlen=COST_SAMPLES))
        window.append((tokens, seconds))
        self.measured_at[b] = now
        self.points[b] = (
            sum(t for t, _ in window) / len(window),
            statistics.median(s for _, s in window),
        )
        self._index()

    def expire(self, now: int) -> None:
        """Forget the buckets not measured since `now` - STALE_STEPS: the cost there is
        interpolated or extrapolated from the others again, and a step of that size, chosen
        by that price, measures it anew."""
        stale = [b for b, at in self.measured_at.items() if at < now - STALE_STEPS]
        for b in stale:
            del self.samples[b], self.measured_at[b], self.points[b]
        if stale:
            self._index()

    def _index(self) -> None:
        self._sorted = sorted(self.points.values())
        self._xs = [p[0] for p in self._sorted]

    def cost(self, tokens: int) -> float | None:
        pts = self._sorted
        if not pts:
            return None
        i = bisect.bisect_left(self._xs, tokens)
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            x1, y1 = pts[-1]
            slope = 0.0
            if len(pts) > 1:
                x0, y0 = pts[-2]
                slope = max(0.0, (y1 - y0) / max(x1 - x0, 1e-9))
            reach = 2.0 * x1  # explored by doublings; beyond, cost in proportion to tokens
            return (y1 + slope * (min(tokens, reach) - x1)) * max(1.0, tokens / reach)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / max(x1 - x0, 1e-9)


class RequestSpecState:
    """One request's speculation counters (meta_info's spec_* fields) and its α."""

    __slots__ = (
        "verify_ct",
        "committed",
        "drafts",
        "accepted",
        "succ",
        "trials",
        "plain_steps",
        "shadow",
        "shadow_node",
        "shadow_accepted",
        "shadow_wait",
        "shadow_backoff",
    )

    def __init__(self) -> None:
        self.verify_ct = 0  # verify steps with at least one draft
        self.committed = 0  # tokens those steps committed (accepted drafts + bonus)
        self.drafts = 0  # draft tokens proposed
        self.accepted = 0  # draft tokens accepted
        self.succ = 1.0  # prior: α = 0.5 until measured
        self.trials = 2.0
        self.plain_steps = 0  # decode steps since it last drafted
        self.shadow: DraftTree | None = None  # a proposal checked against real tokens
        self.shadow_node = 0
        self.shadow_accepted = 0
        self.shadow_wait = 0  # plain steps left before the next shadow proposal
        self.shadow_backoff = 0  # the last wait set; the next miss doubles it

    def alpha(self) -> float:
        return self.succ / self.trials

    def observe(self, accepted: int, depth: int) -> None:
        """A walk down a proposal accepted `accepted` drafts; it was cut by a rejection unless
        it reached the proposal's depth."""
        rejected = 1.0 if accepted < depth else 0.0
        self.succ = DECAY * self.succ + accepted
        self.trials = DECAY * self.trials + accepted + rejected

    def on_verify(self, depth: int, accepted: int, committed: int, drafts: int) -> None:
        self.verify_ct += 1
        self.committed += committed
        self.drafts += drafts
        self.accepted += accepted
        self.plain_steps = 0
        self.shadow = None
        if accepted:
            self._reset_backoff()
        self.observe(accepted, depth)

    # -- shadow verification (NGRAM proposals while decoding plainly) --------------------------
    def wants_shadow(self) -> bool:
        """Whether a new proposal should be made only to be checked against the real tokens."""
        return self.shadow is None and self.shadow_wait == 0

    def start_shadow(self, tree: DraftTree) -> None:
        if self.shadow is None and tree.num_drafts:
            self.shadow, self.shadow_node, self.shadow_accepted = tree, 0, 0
        elif self.shadow is None:  # nothing to propose: as good as a first-draft miss
            self._back_off()

    def _back_off(self) -> None:
        """Wait 1, 2, 4, ... up to MAX_SHADOW_WAIT plain steps before the next proposal."""
        self.shadow_wait = self.shadow_backoff = min(
            max(1, 2 * self.shadow_backoff), MAX_SHADOW_WAIT
        )

    def _reset_backoff(self) -> None:
        """An accepted draft: the next shadow proposal comes at once (a shadow the verify path
        started while a wait was running must not leave the wait behind)."""
        self.shadow_wait = self.shadow_backoff = 0

    def on_plain_token(self, token: int) -> None:
        self.plain_steps += 1
        tree = self.shadow
        if tree is None:
            self.shadow_wait = max(0, self.shadow_wait - 1)
            return
        nxt = next((c for c in tree.children[self.shadow_node] if tree.tokens[c] == token), None)
        depth = max(tree.depths)
        if nxt is None:
            self.observe(self.shadow_accepted, depth)
            self.shadow = None
            if self.shadow_accepted == 0:
                self._back_off()
            else:
                self._reset_backoff()
            return
        self.shadow_node, self.shadow_accepted = nxt, self.shadow_accepted + 1
        if not tree.children[nxt]:
            self.observe(self.shadow_accepted, depth)
            self.shadow = None
            self._reset_backoff()


class SpecController:
    def __init__(self, max_drafts: int, adaptive: bool = True, draft_model: bool = False):
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.draft_model = draft_model
        self.forward_cost = StepCostModel()  # target forward, by tokens
        self.draft_cost = StepCostModel()  # one draft forward, by requests
        self.forwards = 0  # the clock both models age by: a draft forward runs in few steps

    def select(
        self, reqs: list[Any], trees: list[DraftTree], backlog: bool = False
    ) -> list[DraftTree] | None:
        """The trees to verify this step, cut to the depths that pay; None: decode plainly.

        With requests waiting for a place in the batch (`backlog`), what counts is the
        tokens the step commits per second: a request that finishes sooner makes room for
        the next. Without, the running requests are all there is, and they are done when the
        slowest is: what counts is the time until then, remaining tokens over speed, so no
        request is slowed down for another's gain (drafting for some requests makes the step
        longer for all). That needs each request's end: with one that runs until EOS (no
        max_tokens), tokens per second count again."""
        if sum(t.num_drafts for t in trees) == 0:
            return None
        if not self.adaptive:
            return trees
        plain = self.forward_cost.cost(len(reqs))
        if plain is None:
            return None  # nothing measured yet: a plain step first, then one speculative
        alphas = [r.spec.alpha() for r in reqs]
        if self.draft_model:  # a request that stopped drafting probes again now and then
            for i, r in enumerate(reqs):
                if r.spec.plain_steps >= PROBE_INTERVAL:
                    alphas[i] = max(alphas[i], 0.5)
        # (the batch's end is unknown while a request runs to EOS: one without max_tokens,
        # "finishing last" by the context's end, kept every request from speculating)
        known_ends = not any(getattr(r, "open_ended", False) for r in reqs)
        pick = self._best_makespan if known_ends and not backlog else self._best_rate
        keep = pick(reqs, trees, alphas, plain)
        if keep is None:
            return None
        return [t.truncate(d) for t, d in zip(trees, keep, strict=True)]

    def _step_cost(self, tokens: int, depth: int, batch: int, plain: float) -> float:
        cost = self.forward_cost.cost(tokens) or plain
        if self.draft_model:
            cost += depth * (self.draft_cost.cost(batch) or 0.0)
        return cost

    def _best_rate(self, reqs, trees, alphas, plain) -> list[int] | None:
        """Levels by expected gain α_i^level, kept while they raise tokens per second."""
        batch = len(reqs)
        levels: list[tuple[float, int, int]] = []  # (gain, request, level)
        for i, (tree, a) in enumerate(zip(trees, alphas, strict=True)):
            for level in range(1, max(tree.depths) + 1):
                levels.append((a**level, i, level))
        levels.sort(key=lambda x: -x[0])
        widths = [_level_widths(t) for t in trees]
        keep = [0] * len(trees)
        tokens, gain = batch, float(batch)
        best_rate, best_keep = batch / plain, None
        for g, i, level in levels:
            if level != keep[i] + 1:
                continue  # a deeper level only after its parent level
            keep[i] = level
            tokens += widths[i][level]
            gain += g
            rate = gain / self._step_cost(tokens, max(keep), batch, plain)
            if rate > best_rate:
                best_rate, best_keep = rate, list(keep)
        return best_keep

    def _best_makespan(self, reqs, trees, alphas, plain) -> list[int] | None:
        """Levels for whichever request finishes last, kept while its finish comes sooner."""
        batch = len(reqs)
        remaining = [max(1, r.max_new_tokens - len(r.output_ids)) for r in reqs]
        depths = [max(t.depths) for t in trees]
        widths = [_level_widths(t) for t in trees]
        keep = [0] * len(trees)
        expect = [1.0] * len(trees)  # tokens per step: 1 + E_i
        # The requests by steps left (remaining / expect), the last to finish on top.
        heap = [(-float(n), i) for i, n in enumerate(remaining)]
        heapq.heapify(heap)
        tokens, deepest = batch, 0
        best_time, best_keep = max(remaining) * plain, None
        while True:
            i = heap[0][1]
            if keep[i] == depths[i]:
                return best_keep  # the request that finishes last cannot go faster
            keep[i] += 1
            deepest = max(deepest, keep[i])
            expect[i] += alphas[i] ** keep[i]
            tokens += widths[i][keep[i]]
            heapq.heapreplace(heap, (-remaining[i] / expect[i], i))
            t = -heap[0][0] * self._step_cost(tokens, deepest, batch, plain)
            if t < best_time:
                best_time, best_keep = t, list(keep)

    def measured_costs_ms(self) -> dict[str, dict[str, float]]:
        """The cost curves as measured so far ({tokens or requests: milliseconds})."""

        def curve(model: StepCostModel) -> dict[str, float]:
            return {f"{x:.0f}": round(y * 1000, 1) for x, y in sorted(model.points.values())}

        out = {"forward": curve(self.forward_cost)}
        if self.draft_model:
            out["draft_forward"] = curve(self.draft_cost)
        return out

    def record_forward(self, tokens: int, seconds: float) -> None:
        self.forwards += 1
        self.forward_cost.record(tokens, seconds, self.forwards)
        self.forward_cost.expire(self.forwards)
        self.draft_cost.expire(self.forwards)

    def record_draft(self, requests: int, seconds: float) -> None:
        self.draft_cost.record(requests, seconds, self.forwards)


def _level_widths(tree: DraftTree) -> list[int]:
    widths = [0] * (max(tree.depths) + 1)
    for d in tree.depths:
        widths[d] += 1
    return widths
