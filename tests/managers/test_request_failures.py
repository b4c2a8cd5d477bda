"""A per-request failure fails that request, never the scheduler (issue 9, item 4): a grammar
compile that raises or runs past its time, a mask that cannot be filled or allows no token, a
matcher that raises on a token, a stop string match whose decoding raises."""

from __future__ import annotations

from concurrent.futures import Future

import torch
from rs_fake_worker import PackedMaskBackend

from radixserve.managers.grammar_manager import EXPIRED, PENDING, READY, GrammarManager
from radixserve.managers.schedule_batch import Req
from radixserve.sampling_params import SamplingParams

VOCAB = 64


ALLOWED = 7  # the one token a working BrokenGrammar allows


class BrokenGrammar:
    def __init__(
        self, fail_fill: bool = False, fail_accept: bool = False, dead_end: bool = False
    ) -> None:
        self.fail_fill, self.fail_accept, self.dead_end = fail_fill, fail_accept, dead_end

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        if self.fail_fill:
            raise RuntimeError("matcher state corrupted")
        mask[row] = 0  # forbid everything (visible if the row were used)...
        if not self.dead_end:
            mask[row, 0] = 1 << ALLOWED  # ...but one token

    def accept_token(self, token: int) -> bool:
        if self.fail_accept:
            raise RuntimeError("matcher exploded")
        return True

    def is_terminated(self) -> bool:
        return False


class FakeBackend(PackedMaskBackend):
    def new_matcher(self, compiled):
        return BrokenGrammar()


def _manager() -> GrammarManager:
    gm = GrammarManager("xgrammar", tokenizer=object(), vocab_size=VOCAB, eos_ids=[2])
    gm._backend = FakeBackend(VOCAB)
    return gm


def _req(rid: str) -> Req:
    return Req(rid, [5, 6], SamplingParams(regex="a+"))


def test_a_compile_that_raised_fails_its_request_only():
    gm = _manager()
    bad, good = _req("bad"), _req("good")
    bad.grammar, good.grammar = Future(), Future()
    bad.grammar.set_exception(MemoryError("compiler ran out of memory"))
    good.grammar.set_result("compiled")
    gm.queue = [bad, good]
    ready, failed = gm.pop_ready()
    assert ready == [good] and isinstance(good.grammar, BrokenGrammar)
    assert [(r.rid, "out of memory" in msg) for r, msg in failed] == [("bad", True)]
    assert gm.queue == []


def test_a_mask_that_cannot_be_filled_aborts_that_request_at_its_result():
    gm = _manager()
    broken, fine = _req("broken"), _req("fine")
    broken.grammar, fine.grammar = BrokenGrammar(fail_fill=True), BrokenGrammar()
    mask = gm.vocab_mask([broken, fine])
    assert not mask[0].any(), "the failed row must be left unconstrained"
    assert mask[1].sum() == VOCAB - 1 and not mask[1, ALLOWED]
    assert broken.to_abort is not None and "corrupted" in broken.to_abort
    assert fine.to_abort is None


def test_a_mask_that_allows_no_token_aborts_that_request_without_a_token():
    """Sampling among all -inf logits drew token 0 and the request ended "violating" its own
    grammar, with that token in its output."""
    from radixserve.managers.scheduler_output import SchedulerOutputMixin

    gm = _manager()
    dead, fine = _req("dead"), _req("fine")
    dead.grammar, fine.grammar = BrokenGrammar(dead_end=True), BrokenGrammar()
    mask = gm.vocab_mask([dead, fine])
    assert not mask[0].any() and mask[1].sum() == VOCAB - 1
    assert "admits no next token" in dead.to_abort and fine.to_abort is None
    host = SchedulerOutputMixin.__new__(SchedulerOutputMixin)
    host.grammar_manager = gm
    SchedulerOutputMixin._append_token(host, dead, 0, None)
    assert dead.output_ids == [] and dead.finished_reason["type"] == "abort"
    assert "admits no next token" in dead.finished_reason["message"]


def test_a_compile_past_its_deadline_fails_its_request():
    gm = _manager()
    slow, late = _req("slow"), _req("late")
    slow.grammar, late.grammar = Future(), Future()
    slow.grammar_deadline, late.grammar_deadline = 0.0, float("inf")
    gm.queue = [slow, late]
    assert gm.statuses() == [EXPIRED, PENDING]
    ready, failed = gm.pop_ready()
    assert ready == [] and gm.queue == [late]
    assert [(r.rid, "did not compile within" in m) for r, m in failed] == [("slow", True)]


def test_tensor_parallel_ranks_admit_grammars_they_agree_on_without_waiting():
    """Each rank's compile finishes when it does: a request is admitted once every rank's is
    done, timed out when any rank's deadline passed, and nobody blocks on a compile (rank 0
    once waited for every pending one, stalling every other request under TP)."""
    from radixserve.distributed.tp_sync import TpSync

    class Gather:
        def __init__(self, theirs):
            self.theirs = theirs

        def all_gather_ints(self, values):
            return [values, self.theirs]

    mine = [READY, READY, PENDING, EXPIRED, READY]
    theirs = [READY, PENDING, READY, READY, EXPIRED]
    agreed = TpSync(Gather(theirs)).agree_statuses(mine)
    assert agreed == [READY, PENDING, PENDING, EXPIRED, EXPIRED]
    assert TpSync(Gather([])).agree_statuses([]) == []

    gm = _manager()
    reqs = [_req(f"r{i}") for i in range(5)]
    for req in reqs:
        req.grammar = Future()
        req.grammar.set_result("compiled")
    gm.queue = list(reqs)
    ready, failed = gm.pop_ready(agreed)
    assert ready == [reqs[0]] and gm.queue == [reqs[1], reqs[2]]
    assert [r.rid for r, _ in failed] == ["r3", "r4"]


def test_a_matcher_that_raises_finishes_its_request_with_an_abort():
    gm = _manager()
    req = _req("r")
    req.grammar = BrokenGrammar(fail_accept=True)
    gm.accept(req, 7)
    assert req.finished_reason["type"] == "abort"
    assert "exploded" in req.finished_reason["message"]


def test_a_stop_string_match_that_raises_finishes_its_request_with_an_abort():
    class Exploding:
        def decode(self, ids, **_):
            raise OverflowError("out of range integral type conversion attempted")

    req = Req("r", [5, 6], SamplingParams(stop="END", max_new_tokens=9))
    req.output_ids = [7]
    req.check_finished(Exploding())
    assert req.finished_reason["type"] == "abort"
    assert "stop strings" in req.finished_reason["message"]
