"""Regression tests for scheduler crash paths and lost aborts (issue 9, items 1, 2 and 5), over
the fake worker whose KV pool stores token ids: each run checks integrity after every step,
the outputs against the fake model, and a drained pool at the end."""

from __future__ import annotations

import random

import pytest
from rs_fake_worker import FakeRun, PackedMaskBackend, expected_output

from radixserve.managers.schedule_batch import Req
from radixserve.managers.schedule_policy import PrefillAdder
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.model_executor.forward_batch import ForwardMode
from radixserve.sampling_params import SamplingParams


class Run(FakeRun):
    """FakeRun, with a check of every request's outputs against the fake model."""

    def check_complete(self, aborted: set[str] = frozenset()) -> None:
        tokens, reasons = self.tokens(), self.reasons()
        for rid, prompt in self.prompts.items():
            want = expected_output(prompt, self.max_new[rid])
            got = tokens.get(rid, [])
            if rid in aborted:
                assert reasons[rid]["type"] == "abort", f"{rid}: abort lost ({reasons[rid]})"
                assert got == want[: len(got)] and len(got) < len(want)
            else:
                assert reasons[rid]["type"] == "length", (rid, reasons.get(rid))
                assert got == want, rid
        # Every request admitted has finished (an aborted running one was never counted).
        stats = self.s.stats
        assert stats.num_finished == stats.num_requests and stats.num_aborted == len(aborted)


def _shared_prompts(n: int, groups: int = 5, prefix_len: int = 40) -> list[list[int]]:
    prefixes = [[(g * 11 + i) % 90 + 3 for i in range(prefix_len)] for g in range(groups)]
    return [
        prefixes[i % groups] + [(i * 7 + j) % 90 + 3 for j in range(5 + i % 9)] for i in range(n)
    ]


@pytest.mark.parametrize("page_size", [1, 16])
def test_lpm_with_more_than_128_waiting_requests(page_size):
    """lpm falls back to fcfs past 128 waiting requests; admission must still match each one
    against the current tree (it crashed on inc_lock_ref(None), or used evicted nodes)."""
    r = Run(total_tokens=1024, max_running=8, schedule_policy="lpm", page_size=page_size)
    for i, prompt in enumerate(_shared_prompts(200)):
        r.submit(f"q{i}", prompt, max_new=4 + i % 6)
    assert len(r.s.waiting_queue) > 128
    r.drain()
    r.check_complete()


def test_lpm_queue_shrinking_below_the_fallback_threshold():
    """Requests matched while lpm was active, then admitted in fallback rounds (and back)."""
    r = Run(total_tokens=512, max_running=4, schedule_policy="lpm", chunked_prefill_size=32)
    prompts = _shared_prompts(140, groups=3, prefix_len=60)
    for i, prompt in enumerate(prompts[:120]):
        r.submit(f"a{i}", prompt, max_new=6)
    for _ in range(5):
        r.step()
    for i, prompt in enumerate(prompts[120:]):
        r.submit(f"b{i}", prompt, max_new=3)  # crosses 128 while matched requests wait
    r.drain()
    r.check_complete()


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_chunk_with_more_running_requests_than_the_chunk(page_size):
    """24 running decodes would use up a 16-token chunk budget: those rounds run without
    mixing, and the long prompt still gets its chunks (no starvation, exact outputs)."""
    r = Run(
        total_tokens=8192,
        max_running=40,
        enable_mixed_chunk=True,
        chunked_prefill_size=16,
        page_size=page_size,
    )
    for i in range(24):
        r.submit(f"run{i}", [(i * 5 + j) % 90 + 3 for j in range(6)], max_new=60)
    for _ in range(30):
        r.step()
    assert len(r.s.running_batch.reqs) + len(r.s.last_batch.reqs) >= 17
    r.submit("long", [(j * 3) % 90 + 3 for j in range(100)], max_new=8)
    r.submit("short", [9, 8, 7], max_new=5)
    r.drain()
    r.check_complete()


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_chunk_decodes_the_running_requests_beside_every_chunk(overlap):
    """A long prompt's intermediate chunks ran alone: a running request made no progress for
    its whole chunked prefill (12 chunks), as with mixing off."""
    r = Run(total_tokens=4096, overlap=overlap, enable_mixed_chunk=True, chunked_prefill_size=16)
    r.submit("a", [5, 6, 7, 8, 9], max_new=60, stream=True)
    for _ in range(3):
        r.step()
    before = len(r.tokens()["a"])
    r.submit("long", [(j * 7) % 90 + 3 for j in range(200)], max_new=4)
    modes = []
    for _ in range(30):
        batch = r.step()
        if batch.forward_mode == ForwardMode.DECODE:
            break
        modes.append(batch.forward_mode)
    assert len(modes) >= 13 and set(modes) == {ForwardMode.MIXED}
    assert len(r.tokens()["a"]) - before >= len(modes) - 2  # (one step in flight with overlap)
    r.drain()
    r.check_complete()


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_chunk_admits_prompts_beside_a_running_request_with_pages(overlap):
    """Page 16, chunks of 16: one running request left a mixed round 15 tokens of budget, less
    than the page a prompt takes, so nothing was admitted until every running request ended
    (one request at a time: 241 steps for 8 requests instead of 52)."""
    r = Run(
        total_tokens=4096,
        overlap=overlap,
        enable_mixed_chunk=True,
        chunked_prefill_size=16,
        page_size=16,
    )
    for i in range(8):
        r.submit(f"q{i}", [(i * 13 + j) % 90 + 3 for j in range(10)], max_new=30)
        for _ in range(3):
            r.step()
    most = 0
    for _ in range(200):
        if not r.s.has_work():
            break
        batch = r.step()
        most = max(most, len(batch.reqs) if batch is not None else 0)
    assert most >= 6
    r.drain()
    r.check_complete()


def test_chunk_budget_of_exactly_zero_is_a_cap():
    """Mixed decode tokens that use up the chunk budget exactly leave no room for the chunked
    request (0 was read as "no cap", and the whole rest of the prompt was scheduled)."""
    rtp = ReqToTokenPool(16, 512)
    alloc = TokenToKVPoolAllocator(1000)
    cache = RadixCache(rtp, alloc)
    running = [Req(f"d{i}", [3, 4], SamplingParams(max_new_tokens=4)) for i in range(16)]
    adder = PrefillAdder(cache, alloc, running, 0.5, 4096, 16, 32, mixed_decode_tokens=16)
    long = Req("long", list(range(3, 90)), SamplingParams(max_new_tokens=4))
    long.init_next_round_input(cache)
    assert adder.add_chunked_req(long) is long
    assert adder.can_run_list == [] and long.extend_input_len == 87


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stalled_chunked_request_gives_its_kv_back_before_a_running_one_is_aborted(overlap):
    """Pool 31, chunks of 16: a (7 + 19 tokens, 25 slots) decodes while b's prompt (13) stops
    after a chunk of 11, its next chunk getting no budget beside a's reservation. b held its
    slots until a ran out of room, and a, which fits the pool alone, was aborted ("prompt +
    output exceed the pool")."""
    r = Run(total_tokens=31, max_running=4, overlap=overlap, chunked_prefill_size=16)
    r.submit("a", [3 + k * 5 % 90 for k in range(7)], max_new=19)
    r.submit("b", [40 + k for k in range(13)], max_new=1)
    r.drain()
    r.check_complete()
    assert r.s.stats.num_retractions >= 1


def test_abort_right_after_the_final_prefill():
    """The request lives only in last_batch between its prefill and the next round."""
    r = Run()
    r.submit("a", [5, 6, 7, 8], max_new=50)
    batch = r.step()
    assert batch.forward_mode.is_extend() and r.s.running_batch.is_empty()
    r.abort("a")
    r.drain()
    r.check_complete(aborted={"a"})
    assert len(r.tokens()["a"]) <= 2


def test_abort_every_request_after_a_mixed_step():
    """After a mixed step every running request is only in last_batch."""
    r = Run(enable_mixed_chunk=True)
    for i in range(4):
        r.submit(f"run{i}", [i + 3, 4, 5], max_new=50)
    r.step()
    r.step()
    r.submit("new", [7] * 10, max_new=50)
    batch = r.step()
    assert batch.forward_mode.name == "MIXED" and r.s.running_batch.is_empty()
    for rid in [f"run{i}" for i in range(4)] + ["new"]:
        r.abort(rid)
    r.drain()
    r.check_complete(aborted={f"run{i}" for i in range(4)} | {"new"})


def test_abort_of_chunked_request_between_chunks():
    r = Run(chunked_prefill_size=16)
    r.submit("long", list(range(3, 80)), max_new=5)
    r.step()
    assert r.s.chunked_req is not None
    r.abort("long")
    r.drain()
    r.check_complete(aborted={"long"})
    assert r.tokens().get("long", []) == []


def test_abort_of_retracted_request():
    """A request retracted to the waiting queue while its abort is pending is still aborted."""
    r = Run(total_tokens=96, max_running=4)
    for i in range(3):
        r.submit(f"g{i}", [(i * 7 + j) % 90 + 3 for j in range(20)], max_new=60)
    retracted = None
    for _ in range(200):
        r.step()
        if r.s.waiting_queue:
            retracted = r.s.waiting_queue[0].rid
            break
    assert retracted is not None, "no retraction happened"
    r.abort(retracted)
    assert retracted in r.reasons()
    r.drain()
    r.check_complete(aborted={retracted})


@pytest.mark.parametrize("seed", [168, 3, 77])
def test_mixed_chunk_under_a_tight_pool(seed):
    """Random arrivals with mixed chunk and a pool that reservations exhaust: the chunked
    request gets no budget in some rounds (seed 168 crashed in prepare_for_decode on an empty
    output: its final chunk had been taken for an intermediate one)."""
    rng = random.Random(seed)
    r = Run(
        total_tokens=rng.choice([256, 384, 512, 768]),
        max_running=40,
        enable_mixed_chunk=True,
        chunked_prefill_size=rng.choice([16, 32, 64]),
    )
    rng.randint(4, 30)  # keeps the draws of the workload that found the crash
    for step in range(400):
        if step < 60 and rng.random() < 0.4:
            n = rng.choice([3, 5, 8, 40, 100, 150])
            max_new = rng.randint(5, 120)
            rng.random()  # was ignore_eos; the fake model never samples EOS
            r.submit(f"r{step}", [rng.randint(3, 90) for _ in range(n)], max_new)
        r.step()
    r.drain()
    tokens, reasons = r.tokens(), r.reasons()
    for rid, prompt in r.prompts.items():
        want = expected_output(prompt, r.max_new[rid])
        if reasons[rid]["type"] == "abort":  # too long for the pool
            assert "no longer fits" in reasons[rid]["message"]
            assert tokens.get(rid, []) == want[: len(tokens.get(rid, []))]
        else:
            assert tokens[rid] == want


def test_a_chunk_size_that_is_not_a_multiple_of_the_page_says_so(caplog):
    """It was rounded to whole pages silently (8 with pages of 16 ran chunks of 16)."""
    with caplog.at_level("WARNING"):
        r = Run(page_size=16, chunked_prefill_size=8)
    assert r.s.chunked_prefill_size == 16
    assert "--chunked-prefill-size 8 is not a multiple of --page-size 16" in caplog.text


class _Reservations:
    """A P/D decode side that holds `slots` for a request whose KV has not arrived."""

    def __init__(self, slots) -> None:
        self.slots = slots

    def holds_reservations(self) -> bool:
        return self.slots is not None

    def poll(self) -> list:
        return []

    def has_work(self) -> bool:
        return self.slots is not None

    def poll_interval_ms(self) -> int:
        return 50

    def on_aborted(self, req) -> None:
        pass

    def on_finished(self, req) -> bool:
        return False


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_crowded_by_reservations_waits_instead_of_aborting(overlap):
    """P/D decode: slots reserved for a request whose KV is late left the running request
    (10 + 40 tokens, fits the 60-token pool alone) without room; it was aborted ("prompt +
    output exceed the pool"). It now waits, its KV kept, until the reservation resolves."""
    r = Run(total_tokens=60, max_running=4, overlap=overlap)
    r.submit("a", [3 + k for k in range(10)], max_new=40)
    while r.s.running_batch.is_empty():
        r.step()
    reserved = r.s.allocator.alloc(15)
    r.s.disagg = _Reservations(reserved)
    for _ in range(100):  # runs out of room, then waits
        r.step()
    assert "a" not in r.reasons(), r.reasons()  # not aborted: waiting
    assert r.s.poll_timeout_ms(50) == 50  # (and not spinning meanwhile)
    r.s.allocator.free(reserved)  # the reservation failed: its slots are back
    r.s.disagg = None
    r.drain()
    r.check_complete()


def test_the_served_loop_does_not_spin_while_only_a_grammar_compiles():
    """A request waiting for its grammar's compile made the loop poll with no timeout: the
    scheduler burned a core beside the compile. It waits a few milliseconds per poll now,
    and still none while other requests run."""
    from concurrent.futures import Future

    r = Run()
    assert r.s.poll_timeout_ms(50) == 50  # idle
    r.submit("plain", [3, 4, 5], max_new=30)
    r.step()
    compiling: Future = Future()
    gm = r.s.grammar_manager
    gm.tokenizer, gm._backend = object(), PackedMaskBackend()  # (no tokenizer: "disabled")
    gm._backend.get_future = lambda key: compiling  # type: ignore[attr-defined]
    r.submit("constrained", [3, 4, 6], max_new=4, regex="a+")
    assert gm.queue
    assert r.s.poll_timeout_ms(50) == 0  # "plain" decodes
    r.abort("plain")
    while "plain" not in r.reasons():
        r.step()
    assert 0 < r.s.poll_timeout_ms(50) <= 10  # a compile's end is seen within milliseconds
    compiling.set_exception(RuntimeError("closed"))
    r.drain()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_flush_right_after_the_last_output_waits_for_the_step_that_drops_it(overlap):
    """The client has its whole response, but the finished request is still in the running
    batch (or, overlapped, in the step launched before its stop token was seen) until the
    next step: a flush then was refused as "requests are running" (12 of 40 flushes right
    after a streamed response)."""
    from radixserve.io_struct import FlushCacheReq, FlushCacheReqOutput

    def flushes(run: FakeRun) -> list[FlushCacheReqOutput]:
        return [m for m in run.outs if isinstance(m, FlushCacheReqOutput)]

    def finish(run: FakeRun, rid: str) -> None:
        prompt = list(range(1, 9))
        stop = expected_output(prompt, 3)[-1]  # a stop token: seen only once it is sampled
        run.submit(rid, prompt, max_new=16, stop_token_ids=[stop])
        for _ in range(20):
            run.step()
            if rid in run.reasons():
                return
        raise AssertionError(f"{rid} did not finish")

    run = FakeRun(overlap=overlap)
    finish(run, "a")
    assert run.s.has_work(cache_copies=False)  # what the flush used to see
    run.s.process_input_requests([FlushCacheReq()])
    for _ in range(3):
        if flushes(run):
            break
        run.step()
    [answer] = flushes(run)
    assert answer.success, answer.message
    assert run.s.tree_cache.total_size() == 0 and not run.s.has_work()
    run.drain()

    # A flush while a request runs is refused at once; one waiting for the step when a new
    # request comes in is refused after it.
    run.submit("b", list(range(1, 9)), max_new=8)
    run.step()
    run.s.process_input_requests([FlushCacheReq()])
    assert len(flushes(run)) == 2 and not flushes(run)[-1].success
    run.drain()
    finish(run, "c")
    run.s.process_input_requests([FlushCacheReq()])
    assert len(flushes(run)) == 2  # waiting for the step
    run.submit("d", list(range(1, 9)), max_new=2)
    run.step()
    assert len(flushes(run)) == 3 and not flushes(run)[-1].success
    run.drain()


def test_a_request_outgrowing_the_pool_ends_with_the_same_tokens_in_both_loops():
    """Overlapped, the abort ("no longer fits") came while the request's step was in flight
    and dropped the token that step computed: one token fewer than the normal loop (24
    against 25). Its output is capped at the pool now: it ends by length in both loops."""
    got = {}
    for overlap in (False, True):
        run = FakeRun(total_tokens=64, max_running=4, overlap=overlap)
        run.submit("grow", [3] * 40, max_new=200)
        run.drain()
        got[overlap] = run.tokens()["grow"]
        assert run.reasons()["grow"] == {"type": "length", "length": 25}
    assert got[True] == got[False] == expected_output([3] * 40, 200)[:25]


@pytest.mark.parametrize("overlap", [False, True])
def test_max_queued_requests_bounds_the_requests_waiting_for_kv(overlap):
    """--max-queued-requests bounded only the requests in flight against
    --max-running-requests: on a server whose KV pool, not its running slots, was full, 19
    waited with a bound of 4. Now the new requests a round cannot start wait up to the bound,
    the latest past it get a 503; retracted ones are not new and always wait."""
    run = Run(total_tokens=200, max_running=16, overlap=overlap, max_queued_requests=2)
    for i in range(10):
        run.submit(f"r{i}", [10 + i] * 40, max_new=100)
    run.step()
    reasons = run.reasons()
    refused = sorted(rid for rid, r in reasons.items() if r.get("status_code") == 503)
    waiting = [r for r in run.s.waiting_queue if not r.admitted]
    assert len(waiting) == 2 and refused  # (40-token prompts: 200 slots start 4 at most)
    assert refused == [f"r{i}" for i in range(10 - len(refused), 10)]  # the latest
    assert "--max-queued-requests" in reasons[refused[0]]["message"]
    run.drain()
    run.check_complete(aborted=set(refused))  # (the others all ran to the end)
    assert run.s.stats.num_retractions > 0


def test_with_the_priority_policy_the_queue_bound_refuses_the_lowest_ranked():
    """The latest arrivals were refused whatever their priority: a priority-100 request got
    a 503 while priority-0 ones waited. Now, as in SGLang, the lowest-ranked wait no longer
    (the newest of a rank first)."""
    from radixserve.io_struct import TokenizedGenerateReqInput

    run = Run(total_tokens=200, max_running=16, schedule_policy="priority", max_queued_requests=2)
    priorities = [0, 0, 0, 0, 0, 0, 5, 0, 9, 5]
    for i, priority in enumerate(priorities):
        sp = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
        msg = TokenizedGenerateReqInput(f"r{i}", None, [10 + i] * 40, sp, priority=priority)
        run.s.process_input_requests([msg])
    run.step()
    refused = sorted(rid for rid, r in run.reasons().items() if r.get("status_code") == 503)
    waiting = sorted(r.rid for r in run.s.waiting_queue if not r.admitted)
    started = [r.rid for r in run.s.last_batch.reqs]
    assert started and set(started) <= {"r8", "r6", "r9"}  # (the ranks' order: 9, 5, 5)
    rank = sorted(range(10), key=lambda i: (-priorities[i], i))
    kept = [f"r{i}" for i in rank if f"r{i}" not in started][:2]
    assert waiting == sorted(kept)
    assert refused == sorted({f"r{i}" for i in range(10)} - set(started) - set(kept))
    assert "r9" not in refused and "r6" not in refused
    run.drain()


def test_a_request_that_does_not_stream_sends_its_tokens_every_50():
    """A request that does not stream sent nothing until it finished: a server busy with
    long ones showed no output, and /health_generate answered 503 after 60 s. It sends every
    50 tokens now, as SGLang does."""
    run = Run(total_tokens=1024, overlap=False)
    sent = []
    send = run.s.send_output
    run.s.send_output = lambda out: (sent.append([len(i) for i in out.output_ids]), send(out))
    run.submit("r", [5, 6, 7], max_new=120)
    run.submit("s", [8, 9], max_new=3, stream=True)
    run.drain()
    sizes = [n for out in sent for n in out]
    assert sum(sizes) == 123 and sizes.count(1) == 3  # the stream: a token at a time
    assert sorted(n for n in sizes if n != 1) == [20, 50, 50]
    run.check_complete()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_servers_own_requests_are_not_counted(overlap):
    """The warm-up and /health_generate's probes (log_metrics false) were in the dashboard's
    counters: a fresh server showed a request, and a probe every 10 s added 8,640 a day."""
    from radixserve.io_struct import TokenizedGenerateReqInput

    r = Run(overlap=overlap)
    probe = TokenizedGenerateReqInput(
        "probe", None, [5, 6, 7], SamplingParams(max_new_tokens=3), log_metrics=False
    )
    r.s.process_input_requests([probe])
    r.submit("user", [8, 9, 10, 11], max_new=2)
    r.drain()
    stats = r.s.stats
    assert (stats.num_requests, stats.num_finished, stats.num_aborted) == (1, 1, 0)
    assert (stats.prompt_tokens, stats.generation_tokens) == (4, 2)


def test_requests_aborted_before_their_admission_are_counted_as_arrived_and_finished():
    """num_requests counted admissions while num_aborted counted every abort: 6 requests
    aborted in the queue showed 3 requests and 6 aborted."""
    r = Run(max_running=1)
    r.submit("running", [5, 6, 7], max_new=20)
    r.step()
    for i in range(4):
        r.submit(f"queued{i}", [8 + i, 9, 10], max_new=4)
    r.step()
    for i in range(4):
        r.abort(f"queued{i}")
    r.submit("refused", [], max_new=4)  # (an empty prompt: refused on its arrival)
    r.drain()
    stats = r.s.stats
    assert (stats.num_requests, stats.num_finished, stats.num_aborted) == (6, 6, 5)
