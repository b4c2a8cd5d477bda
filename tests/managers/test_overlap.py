"""The overlap loop's own cases (issue 10; seed 000 §10.2–10.4), over the fake worker on the
forward thread: a request that finished at step N but was already launched in N+1, two
prefills in a row, grammar rows (sampling waits for the previous token), penalties, retraction
and abort while a step is in flight, the chunked request, stop strings and logprobs. Every run
checks integrity after each step, compares with the normal loop or the fake model, and ends
with a drained pool."""

from __future__ import annotations

import time

import pytest
import torch
from rs_fake_worker import VOCAB, FakeRun, FakeWorker, PackedMaskBackend, expected_output

from radixserve.args import ServerArgs
from radixserve.io_struct import AbortReq, TokenizedGenerateReqInput
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams


class Run(FakeRun):
    """FakeRun in the overlap loop (or the normal one), streaming every token."""

    def __init__(self, overlap: bool = True, total_tokens: int = 4096, tokenizer=None, **kw):
        super().__init__(total_tokens, 16, tokenizer, overlap, **kw)

    def submit(self, rid: str, prompt: list[int], **params) -> None:
        super().submit(rid, prompt, params.pop("max_new_tokens"), stream=True, **params)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + i * 3) % 90 + 3 for i in range(n)]


def test_a_finished_request_already_launched_again_keeps_its_output():
    want = expected_output(_prompt(1, 10), 3)
    r = Run()
    r.submit("a", _prompt(1, 10), max_new_tokens=10, stop_token_ids=[want[2]])
    r.drain()
    assert r.tokens()["a"] == want
    assert r.reasons()["a"]["type"] == "stop"
    # One prefill and two decodes produce its 3 tokens; the step after them was launched
    # before the third token was processed (and showed the stop token), and its token was
    # dropped.
    assert [rids for rids in r.launched if rids] == [["a"]] * 4
    assert r.s.stats.generation_tokens == 3


def test_no_step_is_launched_after_the_one_that_reaches_max_new_tokens():
    r = Run()
    r.submit("a", _prompt(1, 10), max_new_tokens=3)
    r.drain()
    assert r.tokens()["a"] == expected_output(_prompt(1, 10), 3)
    assert r.reasons()["a"]["type"] == "length"
    assert [rids for rids in r.launched if rids] == [["a"]] * 3  # its last token is known


@pytest.mark.parametrize("page,pool,prompt,max_new", [(1, 40, 20, 21), (16, 48, 20, 29)])
def test_a_request_that_fills_the_pool_exactly_ends_as_in_the_normal_loop(
    page, pool, prompt, max_new
):
    """prompt + max_new_tokens - 1 slots = the pool: the overlap loop wanted a slot for a step
    after the one computing its last token, found none, and aborted it a token early ("no
    longer fits in the KV cache")."""
    for overlap in (True, False):
        r = Run(overlap, total_tokens=pool, page_size=page)
        r.submit("a", _prompt(2, prompt), max_new_tokens=max_new)
        r.drain()
        assert r.reasons()["a"]["type"] == "length", (overlap, r.reasons()["a"])
        assert r.tokens()["a"] == expected_output(_prompt(2, prompt), max_new)


def test_a_request_beside_one_ending_in_the_step_in_flight_is_not_aborted():
    """Pool 64: a (36 + 10 tokens) fits alone, b (12 + 9) ends first. The overlap loop found
    no room for a's next step while b's last step was in flight, and aborted a ("no longer
    fits in the KV cache"); b's slots came back a moment later."""
    b_prompt = [90 - i for i in range(12)]
    for overlap in (True, False):
        r = Run(overlap, total_tokens=64)
        r.submit("a", list(range(3, 39)), max_new_tokens=10)
        r.submit("b", b_prompt, max_new_tokens=9)
        r.drain()
        assert r.reasons()["a"]["type"] == "length", (overlap, r.reasons()["a"])
        assert r.tokens()["a"] == expected_output(list(range(3, 39)), 10)
        assert r.tokens()["b"] == expected_output(b_prompt, 9)


def test_two_prefills_in_a_row_stream_the_first_before_the_second_runs():
    r = Run()
    seen: list[tuple[list[str], int]] = []  # (rids of a forward, outputs sent when it began)
    forward, send = r.worker.forward, r.s.send_output

    def recording_forward(mwb, input_ids=None):
        seen.append((mwb.rids, len(r.outs)))
        return forward(mwb, input_ids)

    def slow_send(msg):
        time.sleep(0.05)  # a forward launched before this send would start meanwhile
        send(msg)

    r.worker.forward, r.s.send_output = recording_forward, slow_send
    r.submit("a", _prompt(1, 10), max_new_tokens=4)
    r.step()  # a's prefill is launched; nothing processed yet
    assert r.tokens() == {}
    r.submit("b", _prompt(2, 12), max_new_tokens=4)
    r.step()  # b's prefill: a's first token goes out before b is launched
    assert r.tokens() == {"a": expected_output(_prompt(1, 10), 1)}
    r.drain()
    assert seen[1] == (["b"], 1)
    assert r.tokens()["b"] == expected_output(_prompt(2, 12), 4)


def _both_loops(make_and_run) -> tuple[Run, Run]:
    runs = []
    for overlap in (True, False):
        run = make_and_run(overlap)
        run.drain()
        runs.append(run)
    return runs[0], runs[1]


def test_retraction_while_a_step_is_in_flight():
    def go(overlap: bool) -> Run:
        # 6 requests of 40 + 40 tokens on a 300-token pool: decode runs out and retracts.
        r = Run(overlap, total_tokens=300, schedule_conservativeness=0.05)
        for i in range(6):
            r.submit(f"r{i}", _prompt(i, 40), max_new_tokens=40)
        return r

    on, off = _both_loops(go)
    assert on.s.stats.num_retractions > 0
    for i in range(6):
        want = expected_output(_prompt(i, 40), 40)
        assert on.tokens()[f"r{i}"] == want
        assert off.tokens()[f"r{i}"] == want


@pytest.mark.parametrize("steps_before_abort", [1, 2, 3, 5])
def test_abort_while_a_step_is_in_flight(steps_before_abort):
    r = Run()
    r.submit("a", _prompt(1, 20), max_new_tokens=30)
    r.submit("b", _prompt(2, 20), max_new_tokens=30)
    for _ in range(steps_before_abort):
        r.step()
    r.s.process_input_requests([AbortReq("a")])
    r.drain()
    got = r.tokens().get("a", [])
    assert r.reasons()["a"]["type"] == "abort"
    assert got == expected_output(_prompt(1, 20), 30)[: len(got)]
    assert r.tokens()["b"] == expected_output(_prompt(2, 20), 30)


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_request_in_the_overlap_loop(mixed):
    def go(overlap: bool) -> Run:
        r = Run(overlap, chunked_prefill_size=16, enable_mixed_chunk=mixed)
        r.submit("short", _prompt(1, 5), max_new_tokens=20)
        r.step()
        r.submit("long", _prompt(2, 70), max_new_tokens=8)  # five chunks
        r.submit("shares", _prompt(2, 70)[:48] + [5, 6], max_new_tokens=8)
        return r

    on, off = _both_loops(go)
    assert on.tokens() == off.tokens()
    assert on.tokens()["long"] == expected_output(_prompt(2, 70), 8)
    assert on.s.stats.cached_tokens >= 48  # the computed chunks were shared


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_string_in_the_overlap_loop():
    prompt = _prompt(3, 15)
    text = CharTokenizer().decode(expected_output(prompt, 40))
    stop = text[10:12]  # finishes at the first place it occurs
    end = text.index(stop) + len(stop)

    def go(overlap: bool) -> Run:
        r = Run(overlap, tokenizer=CharTokenizer())
        r.submit("a", prompt, max_new_tokens=40, stop=stop)
        r.submit("b", _prompt(4, 9), max_new_tokens=40)
        return r

    on, off = _both_loops(go)
    assert on.tokens() == off.tokens()
    assert len(on.tokens()["a"]) == end
    assert on.reasons()["a"] == {"type": "stop", "matched": stop}


def test_logprobs_match_the_normal_loop():
    def go(overlap: bool) -> Run:
        r = Run(overlap)
        for i in range(3):
            r.submit(f"r{i}", _prompt(i, 8 + i), max_new_tokens=6, logprob=True)
        return r

    on, off = _both_loops(go)

    def logprobs(run: Run) -> dict[str, list]:
        got: dict[str, list] = {}
        for msg in run.outs:
            for rid, lps in zip(msg.rids, msg.output_token_logprobs, strict=True):
                got.setdefault(rid, []).extend(lps)
        return got

    assert logprobs(on) == logprobs(off)
    assert all(len(v) == 6 for v in logprobs(on).values())


def test_seeded_sampling_matches_the_normal_loop():
    """A seeded draw uses the token's position, which counts the token still in flight."""

    def go(overlap: bool) -> Run:
        r = Run(overlap)
        for i in range(3):
            r.submit(f"r{i}", _prompt(i, 8), max_new_tokens=12, temperature=1.0, seed=7 + i)
        return r

    on, off = _both_loops(go)
    assert on.tokens() == off.tokens()


def test_penalties_wait_for_the_previous_token():
    def go(overlap: bool) -> Run:
        r = Run(overlap)
        r.submit("a", _prompt(1, 8), max_new_tokens=16, frequency_penalty=2.0)
        r.submit("b", _prompt(2, 8), max_new_tokens=16, repetition_penalty=1.5, min_new_tokens=5)
        r.submit("c", _prompt(3, 8), max_new_tokens=16)
        return r

    on, off = _both_loops(go)
    assert on.tokens() == off.tokens()


# -- grammar: a fake matcher whose only allowed token depends on the last accepted one ---------
def _allowed_after(last: int) -> int:
    return 3 + (last * 5 + 1) % (VOCAB - 3)


class ChainGrammar:
    """Allows exactly one token: _allowed_after(the last accepted token). A mask built before
    the previous token was accepted allows the wrong token, which the matcher then rejects."""

    def __init__(self) -> None:
        self.last = 0

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        t = _allowed_after(self.last)
        mask[row] = 0
        word = 1 << (t % 32)
        mask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept_token(self, token: int) -> bool:
        ok = token == _allowed_after(self.last)
        self.last = token
        return ok

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_rows_sample_after_the_previous_token_is_accepted(overlap):
    r = Run(overlap)
    r.s.grammar_manager._backend = PackedMaskBackend()
    r.submit("g", _prompt(1, 10), max_new_tokens=12)
    r.submit("free", _prompt(2, 10), max_new_tokens=12)
    r.s.waiting_queue[0].grammar = ChainGrammar()
    r.drain()
    want, last = [], 0
    for _ in range(12):
        last = _allowed_after(last)
        want.append(last)
    assert r.reasons()["g"]["type"] == "length", r.reasons()["g"]
    assert r.tokens()["g"] == want
    assert r.tokens()["free"] == expected_output(_prompt(2, 10), 12)


def test_a_failing_forward_fails_the_step_loudly():
    r = Run()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    r.worker.forward = broken
    r.submit("a", _prompt(1, 10), max_new_tokens=3)
    with pytest.raises(RuntimeError, match="device lost"):
        r.drain()


def test_cpus_decide_whether_the_overlap_loop_runs_on_cpu(monkeypatch):
    from radixserve.managers import scheduler

    monkeypatch.setattr(scheduler.torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(scheduler.os, "sched_getaffinity", lambda pid: set(range(4)))
    assert not scheduler.cpus_for_overlap("cpu")
    args = ServerArgs(device="cpu", dtype="float32").resolve()
    s = Scheduler(args, lambda m: None, None, FakeWorker())
    assert not s.enable_overlap  # the normal loop, and no forward thread
    s.process_input_requests(
        [TokenizedGenerateReqInput("a", None, [5, 6, 7], SamplingParams(max_new_tokens=2))]
    )
    while s.has_work():
        s.step()
    assert s.forward_thread is None
    monkeypatch.setattr(scheduler.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert scheduler.cpus_for_overlap("cpu")
    assert scheduler.cpus_for_overlap("cuda")


@pytest.mark.parametrize("overlap", [True, False])
def test_the_forward_runs_with_the_model_threads_while_the_scheduler_runs_on_one(overlap):
    """The served scheduler runs its own work on one intra-op thread (no second OpenMP team
    spinning next to the forward's), and every forward and sampling call gets the model's
    thread count back, on the forward thread or inline."""
    run = Run(overlap=overlap)
    run.s.model_threads = 3
    seen: list[int] = []
    forward, sample = run.worker.forward, run.worker.sample

    def counting_forward(*a, **kw):
        seen.append(torch.get_num_threads())
        return forward(*a, **kw)

    def counting_sample(*a, **kw):
        seen.append(torch.get_num_threads())
        return sample(*a, **kw)

    run.worker.forward, run.worker.sample = counting_forward, counting_sample
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run.submit("a", [5, 6, 7], max_new_tokens=6)
        run.drain()
        assert torch.get_num_threads() == 1  # the scheduler's own thread stays at one
    finally:
        run.s.close()
        torch.set_num_threads(before)
    assert run.tokens()["a"] == expected_output([5, 6, 7], 6)
    assert seen and set(seen) == {3}


def test_the_future_map_resolves_negative_ids_from_the_host_list():
    from radixserve.managers.overlap_utils import FutureMap

    fm = FutureMap(max_batch_size=4)
    slots = fm.alloc([(1, "a"), (2, "b"), (3, "c")])
    fm.store(torch.tensor(slots), torch.tensor([70, 71, 72]))
    assert fm.resolve([5, -slots[1], 9, -slots[0]]).tolist() == [5, 71, 9, 70]
    assert fm.resolve([5, 6]).tolist() == [5, 6]  # no futures: the ids as given
    assert fm.resolve([]).tolist() == []
