"""The speculation controller's cost model and selection (speculative/adaptive.py)."""

from __future__ import annotations

import pytest

from radixserve.speculative.adaptive import (
    STALE_STEPS,
    RequestSpecState,
    SpecController,
    StepCostModel,
)
from radixserve.speculative.spec_info import DraftTree


class _Req:
    def __init__(self, remaining: int = 100, alpha_hits: int = 0) -> None:
        self.spec = RequestSpecState()
        for _ in range(alpha_hits):  # a history of fully accepted 4-deep proposals
            self.spec.observe(4, 4)
        self.max_new_tokens = remaining
        self.output_ids = [7]


def test_cost_interpolates_between_measured_buckets():
    m = StepCostModel()
    assert m.cost(4) is None
    m.record(1, 0.10)
    m.record(8, 0.20)
    assert m.cost(1) == pytest.approx(0.10)
    assert m.cost(8) == pytest.approx(0.20)
    assert m.cost(4) == pytest.approx(0.10 + 0.10 * 3 / 7)


def test_extrapolation_reaches_twice_the_largest_count_then_grows_in_proportion():
    m = StepCostModel()
    m.record(1, 0.10)
    assert m.cost(2) == pytest.approx(0.10)  # one point: flat up to twice its tokens
    assert m.cost(8) == pytest.approx(0.10 * 8 / 2)
    m.record(8, 0.20)
    slope = 0.10 / 7
    assert m.cost(16) == pytest.approx(0.20 + 8 * slope)
    at_reach = 0.20 + 8 * slope
    assert m.cost(68) == pytest.approx(at_reach * 68 / 16)
    assert m.cost(68) > 68 / 32 * m.cost(32) * 0.99  # never cheaper than in proportion


def test_untried_large_batches_decode_plainly_until_their_cost_is_measured():
    """Measured at 1-8 tokens only (a single client), a 32-request batch must not verify a
    tree priced by a slope from 1-8 tokens; once its plain step is measured, trees up to
    twice its tokens are priced and chosen where they pay."""
    ctrl = SpecController(max_drafts=4)
    for tokens, seconds in [(1, 0.080), (2, 0.082), (5, 0.085), (8, 0.090)]:
        ctrl.record_forward(tokens, seconds)
    reqs = [_Req(alpha_hits=6) for _ in range(32)]  # they accept almost everything
    trees = [DraftTree.chain([7, 8, 9, 10, 11]) for _ in reqs]
    assert ctrl.select(reqs, trees) is None
    ctrl.record_forward(32, 0.25)
    chosen = ctrl.select(reqs, trees)
    assert chosen is not None
    verified = sum(len(t) for t in chosen)
    assert 32 < verified <= 64


@pytest.mark.parametrize("open_ended", [False, True])
def test_a_request_without_max_tokens_does_not_stop_the_others_speculating(open_ended):
    """Without a backlog the controller shortens the batch's end, the last request's: one
    that cannot draft (a grammar) and has no max_tokens, so "finishes" at the context's end,
    kept every request from speculating (5 repetitive requests took 94 steps instead of 49).
    Its end is EOS, unknown: then tokens per second decide."""
    ctrl = SpecController(max_drafts=4)
    ctrl.record_forward(2, 0.080)
    ctrl.record_forward(6, 0.085)
    last = _Req(remaining=8000)
    last.open_ended = open_ended
    fast = _Req(remaining=100, alpha_hits=6)
    chosen = ctrl.select([last, fast], [DraftTree.chain([7]), DraftTree.chain([7, 8, 9, 10, 11])])
    if open_ended:
        assert chosen is not None and chosen[1].num_drafts > 0
    else:  # (a known end that no draft brings closer: plain decode, as designed)
        assert chosen is None


def test_a_draft_with_no_acceptance_is_never_verified_once_priced():
    ctrl = SpecController(max_drafts=4)
    ctrl.record_forward(1, 0.080)
    ctrl.record_forward(5, 0.120)
    req = _Req()
    for _ in range(12):
        req.spec.observe(0, 4)
    assert ctrl.select([req], [DraftTree.chain([7, 8, 9, 10, 11])]) is None


def test_shadow_proposals_back_off_after_misses_and_resume_after_a_hit():
    """Random text: a request proposes for a shadow check after waits of 1, 2, 4, 8, 8 plain
    steps; one accepted shadow draft (or a verify that accepted one) proposes at once again."""
    spec = RequestSpecState()
    miss = DraftTree.chain([1, 2, 3])  # its first draft (2) never comes

    def steps_until_wanted() -> int:
        n = 0
        while not spec.wants_shadow():
            spec.on_plain_token(99)
            n += 1
        return n

    waits = []
    for _ in range(5):
        waits.append(steps_until_wanted())
        spec.start_shadow(miss)
        assert not spec.wants_shadow()  # one check at a time
        spec.on_plain_token(99)  # rejected at the first draft
    assert waits == [0, 1, 2, 4, 8]
    assert steps_until_wanted() == 8  # capped
    spec.start_shadow(DraftTree.root_only(1))  # nothing to propose counts as a miss
    assert steps_until_wanted() == 8
    spec.start_shadow(miss)
    spec.on_plain_token(2)  # the first draft accepted, then the second missed
    spec.on_plain_token(99)
    assert spec.wants_shadow()
    spec.start_shadow(DraftTree.root_only(1))
    assert steps_until_wanted() == 1  # the backoff starts over
    for _ in range(3):
        spec.start_shadow(DraftTree.root_only(1))
        spec.on_plain_token(99)
    assert not spec.wants_shadow()
    spec.on_verify(depth=2, accepted=1, committed=2, drafts=2)
    assert spec.wants_shadow()
    # A shadow the verify path starts while a wait runs: its hit ends the wait too.
    spec.start_shadow(DraftTree.root_only(1))
    assert not spec.wants_shadow()
    spec.start_shadow(miss)
    spec.on_plain_token(2)
    spec.on_plain_token(3)  # the whole chain accepted
    assert spec.wants_shadow()


def test_one_slow_step_among_measured_ones_moves_no_price():
    """A plain step of 200 ms among 1 ms ones (a pause, a noisy neighbour) made every later
    step verify drafts that were all rejected: verify steps never re-measure the plain price."""
    m = StepCostModel()
    for seconds in (0.001, 0.001, 0.001, 0.200, 0.001):
        m.record(3, seconds)
    assert m.cost(3) == pytest.approx(0.001)


def test_a_price_measured_once_is_forgotten_and_measured_anew():
    """The first draft forward, timed with its warm-up (100 ms against 0.3 ms), priced drafting
    out for good though every draft was accepted: only drafting steps measure a draft."""
    ctrl = SpecController(max_drafts=4, draft_model=True)
    reqs = [_Req(alpha_hits=6) for _ in range(3)]

    def step(draft_s: float) -> bool:
        """One step of the scheduler's loop: plain 1 ms; a verify, every draft accepted."""
        trees = ctrl.select(reqs, [DraftTree.chain([7, 8, 9, 10, 11]) for _ in reqs])
        if trees is None:
            ctrl.record_forward(3, 0.001)
            return False
        ctrl.record_draft(3, draft_s)
        ctrl.record_forward(sum(len(t) for t in trees), 0.0015)
        for r, t in zip(reqs, trees, strict=True):
            r.spec.on_verify(max(t.depths), t.num_drafts, t.num_drafts + 1, t.num_drafts)
        return True

    assert not step(0.0003)  # nothing measured: a plain step first
    assert step(0.100)  # the first verify, its draft forward slow
    verified = [step(0.0003) for _ in range(STALE_STEPS + 20)]
    assert not any(verified[:10])  # priced out by the slow one
    assert all(verified[-10:])  # forgotten, measured again: drafting pays
