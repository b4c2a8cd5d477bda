"""A per-request failure fails that request, never the scheduler (issue 9, item 4): a grammar
compile that raises, a mask that cannot be filled, a matcher that raises on a token, a stop
string match whose decoding raises."""

from __future__ import annotations

from concurrent.futures import Future

import torch
from rs_fake_worker import PackedMaskBackend

from radixserve.managers.grammar_manager import GrammarManager
from radixserve.managers.schedule_batch import Req
from radixserve.sampling_params import SamplingParams

VOCAB = 64


class BrokenGrammar:
    def __init__(self, fail_fill: bool = False, fail_accept: bool = False) -> None:
        self.fail_fill, self.fail_accept = fail_fill, fail_accept

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        if self.fail_fill:
            raise RuntimeError("matcher state corrupted")
        mask[row] = 0  # forbid everything: visible if the row were used

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
    assert mask[1].all()
    assert broken.to_abort is not None and "corrupted" in broken.to_abort
    assert fine.to_abort is None


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
