"""The TokenizerManager over fake sockets (issue 9, items 3, 6, 9–12 and the detokenizer's side
of 4): what it sends to the scheduler, what it refuses before sending anything, and how its
waiters wake. The "scheduler" here is the test, which feeds BatchStrOutputs back."""

from __future__ import annotations

import asyncio
import math
import shutil
import threading
from typing import Any

import pytest

from radixserve.args import ServerArgs
from radixserve.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    LoadLoRAAdapterReq,
    LoRAUpdateReqOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from radixserve.managers.data_parallel_controller import DataParallelController
from radixserve.managers.detokenizer_manager import DetokenizerManager
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager

VOCAB = 320


class FakeSockets:
    """Both ZMQ sockets of the TokenizerManager: records what it sends, replays outputs."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.inbox: asyncio.Queue = asyncio.Queue()

    def send_pyobj(self, obj: Any) -> None:
        self.sent.append(obj)

    async def recv_pyobj(self) -> Any:
        return await self.inbox.get()

    def close(self, linger: int = 0) -> None:
        pass

    def requests(self) -> list[TokenizedGenerateReqInput]:
        out: list[TokenizedGenerateReqInput] = []
        for m in self.sent:
            if isinstance(m, BatchTokenizedGenerateReqInput):
                out += m.batch
            elif isinstance(m, TokenizedGenerateReqInput):
                out.append(m)
        return out

    def aborts(self) -> list[str]:
        return [m.rid for m in self.sent if isinstance(m, AbortReq)]


class ByteTokenizer:
    def encode(self, text: str, **_: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def _output(rid: str, text: str, ids: list[int], reason: dict | None, **extra: Any):
    return BatchStrOutput(
        rids=[rid],
        finished_reasons=[reason],
        output_strs=[text],
        output_ids=[ids],
        prompt_tokens=[3],
        completion_tokens=[len(ids)],
        cached_tokens=[0],
        **extra,
    )


LENGTH = {"type": "length", "length": 1}


def _make_tm(**args: Any) -> tuple[TokenizerManager, FakeSockets]:
    sockets = FakeSockets()
    tm = TokenizerManager(
        ServerArgs(**args),
        ByteTokenizer(),
        sockets,
        sockets,
        context_len=256,
        vocab_size=VOCAB,
        max_running_requests=2,
    )
    return tm, sockets


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _req(rid: str | None = None, **sp: Any) -> GenerateReqInput:
    return GenerateReqInput(input_ids=[5, 6, 7], sampling_params=sp or None, rid=rid)


async def _collect(tm: TokenizerManager, obj: GenerateReqInput) -> Any:
    out = None
    async for item in tm.generate_request(obj):
        out = item
    return out


# -- item 6: duplicate rids ----------------------------------------------------------------------
def test_duplicate_live_rid_is_refused_and_the_first_still_answers():
    async def body():
        tm, sockets = _make_tm()
        first = asyncio.create_task(_collect(tm, _req("same")))
        await _settle()
        with pytest.raises(RequestError) as e:
            await _collect(tm, _req("same"))
        assert e.value.status_code == 400 and "same" in str(e.value)
        assert [r.rid for r in sockets.requests()] == ["same"]
        await sockets.inbox.put(_output("same", "hi", [1], LENGTH))
        assert (await first)["text"] == "hi"

    run(body())


def test_a_rid_stays_taken_until_the_scheduler_finishes_its_aborted_request(monkeypatch):
    """The scheduler may still send output for an aborted rid: a request that reuses it (a
    client's retry after its timeout) waits for that, a bounded time (it was refused at
    once), and gets only its own output."""
    from radixserve.managers import tokenizer_manager

    async def body():
        tm, sockets = _make_tm()
        first = asyncio.create_task(_collect(tm, _req("r")))
        await _settle()
        first.cancel()  # the client went away: the TokenizerManager aborts it
        await asyncio.gather(first, return_exceptions=True)
        assert sockets.aborts() == ["r"]
        monkeypatch.setattr(tokenizer_manager, "RID_DRAIN_WAIT_S", 0.05)
        with pytest.raises(RequestError, match="already running"):  # (no last output came)
            await _collect(tm, _req("r"))
        monkeypatch.setattr(tokenizer_manager, "RID_DRAIN_WAIT_S", 10.0)
        again = asyncio.create_task(_collect(tm, _req("r")))
        await asyncio.sleep(0.05)
        assert len(sockets.requests()) == 1  # it waits
        await sockets.inbox.put(_output("r", "late", [1], {"type": "abort", "message": "x"}))
        for _ in range(100):
            if len(sockets.requests()) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(sockets.requests()) == 2
        await sockets.inbox.put(_output("r", "new", [2], LENGTH))
        assert (await again)["text"] == "new"

    run(body())


def test_a_request_whose_client_went_away_still_counts_in_the_metrics():
    """Its late outputs are not delivered, but /metrics counts its tokens and its finish (the
    requests minus the finished ones grew by one per disconnect)."""
    from radixserve.managers.metrics import ServerMetrics

    def value(metrics: ServerMetrics, name: str) -> float:
        return metrics.registry.get_sample_value("sglang:" + name, {"model_name": "m"}) or 0.0

    async def body():
        tm, sockets = _make_tm()
        tm.metrics = metrics = ServerMetrics("m")
        task = asyncio.create_task(_collect(tm, _req("r")))
        await _settle()
        await sockets.inbox.put(_output("r", "a", [1], None))
        await _settle()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert sockets.aborts() == ["r"] and "r" not in tm.rid_to_state
        await sockets.inbox.put(_output("r", "bc", [2, 3], None))
        await sockets.inbox.put(_output("r", "", [], {"type": "abort", "message": "gone"}))
        await _settle()
        assert value(metrics, "num_requests_total") == 1
        assert value(metrics, "num_finished_reqs_total") == 1
        assert value(metrics, "generation_tokens_total") == 3
        assert value(metrics, "e2e_request_latency_seconds_count") == 1
        assert value(metrics, "num_aborted_requests_total") == 1
        assert "r" not in tm._draining  # the rid is free again

    run(body())


def test_the_servers_own_probe_is_not_counted_as_a_request():
    """/health_generate's probe (log_metrics False) added to every request metric: a
    Kubernetes probe every few seconds skewed the request rate and latencies of an idle
    replica (SGLang's probe is not logged either)."""
    from radixserve.managers.metrics import ServerMetrics

    def value(metrics: ServerMetrics, name: str) -> float:
        return metrics.registry.get_sample_value("sglang:" + name, {"model_name": "m"}) or 0.0

    async def body():
        tm, sockets = _make_tm()
        tm.metrics = metrics = ServerMetrics("m")
        probe = GenerateReqInput(input_ids=[0], rid="probe", log_metrics=False)
        task = asyncio.create_task(_collect(tm, probe))
        await _settle()
        await sockets.inbox.put(_output("probe", "a", [1], LENGTH))
        await task
        # one that /health_generate cancels (it was queued behind others): no abort counted,
        # where aborts had outnumbered the requests
        queued = GenerateReqInput(input_ids=[0], rid="queued", log_metrics=False)
        task = asyncio.create_task(_collect(tm, queued))
        await _settle()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sockets.inbox.put(_output("queued", "", [], {"type": "abort", "message": "gone"}))
        await _settle()
        names = ("num_requests_total", "prompt_tokens_total", "generation_tokens_total")
        for name in (*names, "num_aborted_requests_total"):
            assert value(metrics, name) == 0, name
        assert value(metrics, "time_to_first_token_seconds_count") == 0
        assert tm.latency_window.snapshot()["finished_requests"] == 0

    run(body())


def test_a_cancel_right_after_the_output_arrived_is_not_lost():
    """asyncio.wait_for (Python 3.11) swallowed a cancel landing after the request's event had
    fired and before the waiting task resumed: a closed stream's (or Ctrl-C'd) request ran on
    to its end with nobody reading it. The wait the TokenizerManager uses keeps the cancel."""
    from radixserve.managers.tokenizer_manager import _wait_event

    async def body():
        event = asyncio.Event()
        task = asyncio.ensure_future(_wait_event(event, 5.0))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        event.set()
        await asyncio.sleep(0)  # the event's waiter is done; the task has not resumed yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _wait_event(event, 5.0) is True
        assert await _wait_event(asyncio.Event(), 0.01) is False

    run(body())


def test_duplicate_rids_inside_a_batch_send_nothing():
    async def body():
        tm, sockets = _make_tm()
        obj = GenerateReqInput(input_ids=[[5], [6]], rid=["a", "a"])
        with pytest.raises(RequestError):
            await _collect(tm, obj)
        assert sockets.sent == []

    run(body())


def _batch(rid: str, n: int = 1) -> GenerateReqInput:
    return GenerateReqInput(input_ids=[[5], [6]], rid=rid, sampling_params={"n": n})


@pytest.mark.parametrize(
    "first, second",
    [
        (lambda: _req("p", n=2), lambda: _req("p")),  # the rid of choices p_0, p_1 in flight
        (lambda: _batch("p"), lambda: _req("p")),  # the rid of a batch's prompts in flight
        (lambda: _req("p"), lambda: _req("p", n=2)),  # choices whose rid is in flight
        (lambda: _req("p", n=2), lambda: _batch("p", n=2)),  # p_0_0, ... of a second group p
    ],
)
def test_the_rid_of_an_n_request_or_a_batch_in_flight_is_taken(first, second):
    """/abort_request with the rid of an n > 1 request or a batch aborts its sub-requests
    (`<rid>_<i>`); a request given the same rid meanwhile was admitted, and the abort then
    stopped only that one."""

    async def body():
        tm, sockets = _make_tm()
        task = asyncio.create_task(_collect(tm, first()))
        await _settle()
        sent = sockets.requests()
        refused = asyncio.create_task(_collect(tm, second()))
        for _ in range(100):  # (admitted, it would wait for output)
            if refused.done():
                break
            await asyncio.sleep(0.01)
        assert refused.done() and sockets.requests() == sent
        with pytest.raises(RequestError, match="'p' is already running") as e:
            await refused
        assert e.value.status_code == 400
        for t in sent:
            await sockets.inbox.put(_output(t.rid, "hi", [1], LENGTH))
        assert await task

    run(body())


# -- item 9: n > 1 with a seed -------------------------------------------------------------------
def test_seeded_choices_get_their_own_seeds():
    async def body():
        tm, sockets = _make_tm()
        task = asyncio.create_task(_collect(tm, _req(n=3, seed=41)))
        await _settle()
        sent = sockets.requests()
        assert [t.sampling_params.seed for t in sent] == [41, 42, 43]
        assert all(t.sampling_params.n == 1 for t in sent)
        assert len({t.rid for t in sent}) == 3
        for t in sent:
            await sockets.inbox.put(_output(t.rid, "x", [1], LENGTH))
        assert len(await task) == 3

    run(body())


# -- item 10: sub-requests cancelled together ----------------------------------------------------
def test_a_failed_choice_aborts_its_siblings():
    async def body():
        tm, sockets = _make_tm()
        task = asyncio.create_task(_collect(tm, _req(n=3)))
        await _settle()
        rids = [t.rid for t in sockets.requests()]
        rejected = {"type": "abort", "message": "does not fit", "status_code": 400}
        await sockets.inbox.put(_output(rids[1], "", [], rejected))
        with pytest.raises(RequestError, match="does not fit"):
            await task
        assert sorted(sockets.aborts()) == sorted([rids[0], rids[2]])
        assert tm.rid_to_state == {}

    run(body())


def test_the_rid_of_an_n_request_names_and_aborts_its_choices():
    """n > 1: the choices are `<rid>_<i>` (SGLang's), and /abort_request with the request's
    own rid aborts every choice; each waiter then gets finish_reason abort."""

    async def body():
        tm, sockets = _make_tm()
        task = asyncio.create_task(_collect(tm, _req("mine", n=3)))
        await _settle()
        rids = [t.rid for t in sockets.requests()]
        assert rids == ["mine_0", "mine_1", "mine_2"]
        assert not tm.request_abort("min") and sockets.aborts() == []
        assert tm.request_abort("mine")
        assert sorted(sockets.aborts()) == rids
        aborted = {"type": "abort", "message": "aborted by request"}
        for rid in rids:
            await sockets.inbox.put(_output(rid, "", [], aborted))
        outs = await task
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
        assert tm.rid_to_state == {}

    run(body())


@pytest.mark.parametrize("n", [1, 2])
def test_the_one_rid_of_a_batch_names_and_aborts_its_prompts(n):
    """A batch with one rid: its prompts are `<rid>_<i>` (SGLang's) and /abort_request with
    that rid aborts them all; the rid was dropped and nothing could abort the batch."""

    async def body():
        tm, sockets = _make_tm()
        obj = GenerateReqInput(input_ids=[[5], [6]], rid="b", sampling_params={"n": n})
        task = asyncio.create_task(_collect(tm, obj))
        await _settle()
        rids = [t.rid for t in sockets.requests()]
        want = ["b_0", "b_1"] if n == 1 else ["b_0_0", "b_1_0", "b_0_1", "b_1_1"]
        assert sorted(rids) == sorted(want)
        assert tm.request_abort("b")
        assert sorted(sockets.aborts()) == sorted(rids)
        aborted = {"type": "abort", "message": "aborted by request"}
        for rid in rids:
            await sockets.inbox.put(_output(rid, "", [], aborted))
        outs = await task
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * len(rids)
        assert tm.rid_to_state == {}

    run(body())


def test_cancelling_a_batch_aborts_every_sub_request():
    async def body():
        tm, sockets = _make_tm()
        obj = GenerateReqInput(input_ids=[[5], [6], [7]])
        task = asyncio.create_task(_collect(tm, obj))
        await _settle()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert sorted(sockets.aborts()) == sorted(t.rid for t in sockets.requests())
        assert tm.rid_to_state == {}

    run(body())


# -- item 11: the queue bound --------------------------------------------------------------------
def test_past_the_queue_bound_a_request_gets_503_at_once():
    async def body():
        tm, sockets = _make_tm(max_queued_requests=1)  # 2 running + 1 queued
        tasks = [asyncio.create_task(_collect(tm, _req())) for _ in range(3)]
        await _settle()
        with pytest.raises(RequestError) as e:
            await _collect(tm, _req())
        assert e.value.status_code == 503 and e.value.headers["Retry-After"] == "1"
        with pytest.raises(RequestError):  # n counts: 2 choices would pass the bound too
            await _collect(tm, _req(n=2))
        assert len(sockets.requests()) == 3
        for t in sockets.requests():
            await sockets.inbox.put(_output(t.rid, "ok", [1], LENGTH))
        assert [o["text"] for o in await asyncio.gather(*tasks)] == ["ok"] * 3

    run(body())


def test_with_the_priority_policy_a_request_that_outranks_one_in_flight_passes_the_bound():
    """A priority-100 request got the 503 while priority-0 ones waited; it goes to the
    scheduler now, which refuses the lowest-ranked waiting request instead."""

    async def body():
        tm, sockets = _make_tm(max_queued_requests=1, schedule_policy="priority")
        tasks = [asyncio.create_task(_collect(tm, _req())) for _ in range(3)]
        await _settle()
        for obj in (_req(), GenerateReqInput(input_ids=[5, 6], priority=0)):
            with pytest.raises(RequestError) as e:
                await _collect(tm, obj)
            assert e.value.status_code == 503
        high = GenerateReqInput(input_ids=[5, 6], priority=100, rid="high")
        tasks.append(asyncio.create_task(_collect(tm, high)))
        await _settle()
        assert [t.rid for t in sockets.requests()][-1] == "high"
        for t in sockets.requests():
            await sockets.inbox.put(_output(t.rid, "ok", [1], LENGTH))
        assert [o["text"] for o in await asyncio.gather(*tasks)] == ["ok"] * 4

    run(body())


def test_a_batch_larger_than_the_queue_bound_is_a_400_even_when_idle():
    """It got a 503 with Retry-After: 1 on an idle server; no retry could ever pass."""

    async def body():
        tm, sockets = _make_tm(max_queued_requests=1)  # 2 running + 1 queued
        for obj in (_req(n=4), GenerateReqInput(input_ids=[[5], [6], [7], [8]])):
            with pytest.raises(RequestError) as e:
                await _collect(tm, obj)
            assert e.value.status_code == 400 and "split it" in str(e.value)
        assert sockets.requests() == []

    run(body())


# -- item 12: a slow streaming client ------------------------------------------------------------
def test_a_slow_stream_reader_sees_the_latest_state_not_a_backlog():
    async def body():
        tm, sockets = _make_tm()
        obj = GenerateReqInput(input_ids=[5], stream=True)
        gen = tm.generate_request(obj)
        first = asyncio.create_task(gen.__anext__())
        await _settle()
        rid = sockets.requests()[0].rid
        for i in range(500):
            await sockets.inbox.put(_output(rid, "a", [i % 200], None))
        await sockets.inbox.put(_output(rid, "!", [1], LENGTH))
        await _settle()
        for _ in range(600):
            if not tm.rid_to_state:
                break
            await asyncio.sleep(0)
        item = await first  # the reader wakes once: one cumulative item, nothing queued
        assert item["text"] == "a" * 500 + "!" and len(item["output_ids"]) == 501
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()

    run(body())


def test_a_slow_reader_of_a_batch_stream_gets_each_output_as_it_was():
    """A streamed batch (or n > 1) queues its sub-requests' outputs for the reader; a queued
    one shared its state's lists, which later outputs extended: a chunk's output_ids held
    tokens its text and completion_tokens did not (621 of 936 chunks for a slow client)."""

    async def body():
        tm, sockets = _make_tm()
        gen = tm.generate_request(GenerateReqInput(input_ids=[[5], [6]], stream=True))
        first = asyncio.create_task(gen.__anext__())
        await _settle()
        rids = [r.rid for r in sockets.requests()]
        for i in range(1, 41):  # the reader is away while 40 steps arrive
            reason = LENGTH if i == 40 else None
            out = _output(rids[0], "a", [i], reason)  # (text and ids are deltas)
            out.completion_tokens = [i]
            await sockets.inbox.put(out)
            out = _output(rids[1], "a", [i], reason)
            out.completion_tokens = [i]
            await sockets.inbox.put(out)
            await _settle()
        items = [await first]
        async for item in gen:
            items.append(item)
        assert len(items) < 2 * 40  # held outputs are coalesced, not one per step
        for item in items:
            meta = item["meta_info"]
            assert len(item["output_ids"]) == meta["completion_tokens"] == len(item["text"])
        last = {item["index"]: item for item in items}
        assert sorted(last) == [0, 1]
        assert all(len(item["output_ids"]) == 40 for item in last.values())

    run(body())


def test_a_finish_that_arrives_while_the_reader_holds_an_item_is_still_yielded():
    async def body():
        tm, sockets = _make_tm()
        gen = tm.generate_request(GenerateReqInput(input_ids=[5], stream=True))
        first = asyncio.create_task(gen.__anext__())
        await _settle()
        rid = sockets.requests()[0].rid
        await sockets.inbox.put(_output(rid, "a", [1], None))
        assert (await first)["meta_info"]["finish_reason"] is None
        # The reader is busy with "a" (sending it) when the finish comes in.
        await sockets.inbox.put(_output(rid, "b", [2], LENGTH))
        await _settle()
        last = await gen.__anext__()
        assert last["text"] == "ab" and last["meta_info"]["finish_reason"]["type"] == "length"

    run(body())


# -- item 3: one validation path -----------------------------------------------------------------
@pytest.mark.parametrize(
    "field, obj",
    [
        ("top_logprobs_num", GenerateReqInput(input_ids=[5], top_logprobs_num=1_000_000)),
        ("top_logprobs_num", GenerateReqInput(input_ids=[5], top_logprobs_num=-1)),
        ("temperature", _req(temperature=math.nan)),
        ("temperature", _req(temperature=math.inf)),
        ("top_p", _req(top_p=math.nan)),
        ("frequency_penalty", _req(frequency_penalty="x")),
        ("presence_penalty", _req(presence_penalty=[1])),
        ("repetition_penalty", _req(repetition_penalty=None)),
        ("max_new_tokens", _req(max_new_tokens=1.5)),
        ("top_k", _req(top_k=True)),
        ("seed", _req(seed=-3)),
        ("seed", _req(seed="7")),
        ("ignore_eos", _req(ignore_eos="yes")),
        ("json_schema", _req(json_schema={"type": "object"})),
        ("logit_bias", _req(logit_bias=[1, 2])),
        # One token spelled twice got both biases (400 past the ±100 bound); int() spellings.
        ("logit_bias", _req(logit_bias={"5": 100, "05": 100})),
        ("logit_bias", _req(logit_bias={"5": 1, 5: 1})),
        ("logit_bias", _req(logit_bias={" 5": 1})),
        ("logit_bias", _req(logit_bias={"1_0": 1})),
        ("logit_bias", _req(logit_bias={"\u0665": 1})),
        ("logit_bias", _req(logit_bias={True: 1})),
        ("stop", _req(stop=5)),
        ("stop", _req(stop={"x": 1})),
        ("stop", _req(stop=["x", 3])),
        ("stop_token_ids", _req(stop_token_ids=5)),
        ("stop_token_ids", _req(stop_token_ids="12")),
        ("stop_token_ids", _req(stop_token_ids={"1": 2})),
        ("n", _req(n=0)),
        ("n", _req(n=10_000)),
        ("priority", GenerateReqInput(input_ids=[5], priority="high")),
        ("stream", GenerateReqInput(input_ids=[5], stream="yes")),
        ("return_logprob", GenerateReqInput(input_ids=[5], return_logprob=1)),
        ("rid", GenerateReqInput(input_ids=[5], rid=7)),
        ("rid", GenerateReqInput(input_ids=[[5], [6]], rid=["a"])),
        ("input_ids", GenerateReqInput(input_ids=[5.0, 6])),
        ("input_ids", GenerateReqInput(input_ids=[[5], "x"])),
        ("text", GenerateReqInput(text=[1, 2])),
        ("sampling_params", GenerateReqInput(input_ids=[5], sampling_params="greedy")),
        ("logprob_start_len", GenerateReqInput(input_ids=[5], logprob_start_len=-2)),
        ("logprob_start_len", GenerateReqInput(input_ids=[5], logprob_start_len="0")),
        (
            "logprob_start_len",
            GenerateReqInput(input_ids=[5, 6], return_logprob=True, logprob_start_len=3),
        ),
        ("return_text_in_logprobs", GenerateReqInput(input_ids=[5], return_text_in_logprobs=1)),
        ("extra_key", GenerateReqInput(input_ids=[5], extra_key=3)),
        ("unknown sampling parameter", _req(temprature=0.5)),
    ],
)
def test_bad_fields_are_refused_before_dispatch(field, obj):
    async def body():
        tm, sockets = _make_tm()
        with pytest.raises(RequestError) as e:
            await _collect(tm, obj)
        assert e.value.status_code == 400 and field in str(e.value)
        assert sockets.sent == []

    run(body())


# -- item 8 (the TokenizerManager's part): a dead child fails every waiter -------------------------
def test_fail_all_wakes_every_waiter_and_refuses_new_requests():
    async def body():
        tm, sockets = _make_tm()
        tasks = [asyncio.create_task(_collect(tm, _req())) for _ in range(2)]
        await _settle()
        tm.fail_all("radixserve-scheduler exited with code -9")
        for t in tasks:
            with pytest.raises(RequestError) as e:
                await t
            assert e.value.status_code == 503 and "exited" in str(e.value)
        with pytest.raises(RequestError):
            await _collect(tm, _req())

    run(body())


def test_fail_all_fails_control_calls_waiting_and_later_ones_at_once():
    """flush_cache and server info waited their 30 s timeout for a dead scheduler, then
    raised a bare TimeoutError (a LoRA load waited 300 s)."""

    async def body():
        tm, _ = _make_tm()
        waiting = asyncio.create_task(tm.flush_cache())
        await _settle()
        tm.fail_all("radixserve-scheduler exited with code 1")
        for call in (lambda: waiting, tm.flush_cache, tm.get_server_info):
            with pytest.raises(RequestError) as e:
                await asyncio.wait_for(call(), 2)
            assert e.value.status_code == 503 and "exited with code 1" in str(e.value)

    run(body())


def test_fail_all_fails_data_parallel_control_calls_in_flight():
    """With --dp-size the calls wait in the DataParallelController for every replica's reply;
    one replica dead, they waited their timeout (30 s, 300 s for a LoRA load)."""

    async def body():
        sockets = FakeSockets()
        ctl = DataParallelController([FakeSockets(), FakeSockets()], "round_robin")
        tm = TokenizerManager(
            ServerArgs(), ByteTokenizer(), ctl, sockets, 256, VOCAB, dp_controller=ctl
        )
        waiting = asyncio.create_task(tm.flush_cache())
        await _settle()
        ctl.on_reply(FlushCacheReqOutput(True))  # one replica answered, the other died
        tm.fail_all("radixserve-scheduler-dp1 exited with code -9")
        with pytest.raises(RequestError) as e:
            await asyncio.wait_for(waiting, 2)
        assert e.value.status_code == 503 and "dp1 exited" in str(e.value)

    run(body())


def test_a_control_call_the_scheduler_never_answers_is_a_503():
    """A stalled scheduler: /get_server_info, /flush_cache answered a bare 500 (TimeoutError)."""

    async def body():
        tm, _ = _make_tm()
        for make in (lambda: tm, lambda: _dp_tm()):
            with pytest.raises(RequestError) as e:
                await make()._control(FlushCacheReq(), FlushCacheReqOutput, 0.05)
            assert e.value.status_code == 503 and "did not answer FlushCacheReq" in str(e.value)

    run(body())


def test_an_adapter_is_hashed_off_the_event_loop(monkeypatch, tmp_path):
    """/load_lora_adapter hashed the adapter's weights on the serving loop: a 1 GB file held
    every request and stream of the server for 5 s."""
    import threading

    from radixserve.managers import tokenizer_manager

    hashed_on = []

    def key(name: str, path: str) -> str:
        hashed_on.append(threading.current_thread())
        raise OSError("stop here")

    monkeypatch.setattr(tokenizer_manager, "check_adapter_dir", lambda path: None)
    monkeypatch.setattr(tokenizer_manager, "adapter_key", key)

    async def body():
        tm, _ = _make_tm(enable_lora=True)
        out = await tm.load_lora_adapter("a", str(tmp_path))
        assert not out.success and out.message == "stop here"

    run(body())
    assert hashed_on and hashed_on[0] is not threading.main_thread()


def _dp_tm() -> TokenizerManager:
    ctl = DataParallelController([FakeSockets(), FakeSockets()], "round_robin")
    args = ServerArgs(enable_lora=True)
    return TokenizerManager(
        args, ByteTokenizer(), ctl, FakeSockets(), 256, VOCAB, dp_controller=ctl
    )


# -- item 4: a request the detokenizer cannot decode --------------------------------------------
class FlakyTokenizer(ByteTokenizer):
    def decode(self, ids: list[int], **kw: Any) -> str:
        if 255 in ids:
            raise RuntimeError("cannot decode token 255")
        return super().decode(ids, **kw)


def _token_out(rids: list[str], ids: list[list[int]], reasons: list[dict | None]):
    k = len(rids)
    return BatchTokenIDOutput(
        rids, reasons, ids, [True] * k, [True] * k, [False] * k, [[]] * k, [3] * k, [1] * k, [0] * k
    )


def test_detokenizer_fails_only_the_request_it_cannot_decode():
    detok = DetokenizerManager(FlakyTokenizer())
    out = detok.handle_batch_token_id_out(_token_out(["bad", "good"], [[255], [104]], [None] * 2))
    assert out.output_strs[1] == "h" and out.finished_reasons[1] is None
    assert out.finished_reasons[0]["type"] == "abort"
    assert "cannot decode" in out.finished_reasons[0]["message"]
    assert out.failed_rids == ["bad"]
    # Later deltas of the failed request are dropped; its final one passes (nothing to decode).
    later = detok.handle_batch_token_id_out(
        _token_out(["bad", "good"], [[104], [105]], [None, None])
    )
    assert later.output_strs == ["", "i"] and later.failed_rids == []
    last = detok.handle_batch_token_id_out(_token_out(["bad"], [[104]], [LENGTH]))
    assert last.output_strs == [""] and last.finished_reasons == [LENGTH]
    assert detok.failed == set() and "bad" not in detok.states


def test_tokenizer_manager_stops_a_request_the_detokenizer_failed():
    async def body():
        tm, sockets = _make_tm()
        task = asyncio.create_task(_collect(tm, _req("r")))
        await _settle()
        failed = {"type": "abort", "message": "detokenization failed: boom"}
        await sockets.inbox.put(_output("r", "", [], failed, failed_rids=["r"]))
        out = await task
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert sockets.aborts() == ["r"]

    run(body())


def test_outputs_are_drained_from_a_real_socket_in_order():
    """start() reads the detokenizer's socket through a reader on its FD: messages queued
    before it, bursts longer than DRAIN_BATCH, and messages after one that does not unpickle
    all arrive, in order."""
    import zmq
    import zmq.asyncio

    from radixserve.managers.tokenizer_manager import DRAIN_BATCH

    async def body():
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind("inproc://tm-drain")
        push = zmq.Context.shadow(ctx.underlying).socket(zmq.PUSH)
        push.connect("inproc://tm-drain")
        tm = TokenizerManager(
            ServerArgs(), ByteTokenizer(), FakeSockets(), pull, context_len=256, vocab_size=VOCAB
        )
        got: list[Any] = []
        tm._dispatch = got.append  # type: ignore[method-assign]
        expected = [("early", i) for i in range(5)]
        for m in expected:
            push.send_pyobj(m)
        tm.start()
        burst = [("burst", i) for i in range(2 * DRAIN_BATCH + 7)]
        for m in burst:
            push.send_pyobj(m)
        push.send(b"not a pickle")
        late = [("late", i) for i in range(3)]
        for m in late:
            push.send_pyobj(m)
        expected += burst + late
        for _ in range(500):
            if len(got) >= len(expected):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert got == expected
        for m in expected[:2]:  # and it keeps receiving after going idle
            push.send_pyobj(m)
        for _ in range(200):
            if len(got) >= len(expected) + 2:
                break
            await asyncio.sleep(0.01)
        push.close(linger=0)
        tm.close()
        assert got == expected + expected[:2]

    run(body())


def test_a_detokenizer_that_cannot_start_says_why_on_its_ready_pipe(tmp_path):
    """An unhandled error printed the process's traceback and the parent saw only its exit."""
    import multiprocessing as mp

    from radixserve.managers.detokenizer_manager import run_detokenizer_process
    from radixserve.utils import PortArgs

    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    ctx = mp.get_context("spawn")
    read, write = ctx.Pipe(duplex=False)
    args, port_args = ServerArgs(model_path=str(bad), log_level="error"), PortArgs.new()
    proc = ctx.Process(target=run_detokenizer_process, args=(args, port_args, write))
    proc.start()
    try:
        assert read.poll(60)
        msg = read.recv()
        proc.join(30)
        assert msg["status"] == "error" and msg["message"], msg
        assert proc.exitcode == 1
    finally:
        proc.kill()
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


class _CheckThat:
    """A grammar check that runs `during` on its thread, then waits until closed (or not)."""

    def __init__(self, during: Any = None, block: bool = False) -> None:
        self.during, self.block = during, block
        self.entered, self.closed = threading.Event(), threading.Event()

    def check(self, sp: Any) -> None:
        self.entered.set()
        if self.during is not None:
            self.during()
        if self.block:
            self.closed.wait(15)
            raise RuntimeError("the grammar backend is closed")

    def close(self) -> None:
        self.closed.set()


def test_a_request_in_its_grammar_check_when_the_scheduler_dies_gets_a_503():
    """fail_all answered only registered requests: one still in its grammar check waited for
    the compile (tens of seconds for a large schema), then was sent to a dead scheduler."""

    async def body():
        tm, sockets = _make_tm()
        tm._grammar_check = check = _CheckThat(block=True)
        task = asyncio.create_task(_collect(tm, _req(json_schema='{"type": "string"}')))
        assert await asyncio.to_thread(check.entered.wait, 5)
        tm.fail_all("radixserve-scheduler exited with code -9")
        with pytest.raises(RequestError) as e:
            await asyncio.wait_for(task, 5)
        assert e.value.status_code == 503 and "exited" in str(e.value)
        assert sockets.requests() == []

    run(body())


# -- LoRA loads and unloads ---------------------------------------------------------------------
def _with_adapter(tm: TokenizerManager, name: str = "a") -> None:
    tm.lora_paths[name], tm.lora_keys[name] = f"/adapters/{name}", f"lora:{name}"


@pytest.mark.parametrize("lora", [["a"], [None], ["a", "a"]])
def test_one_prompt_may_name_its_adapter_in_a_one_item_list(lora):
    """SGLang takes lora_path ["a"] for one prompt: the Engine did, /generate and the OpenAI
    endpoints answered 400."""

    async def body():
        tm, sockets = _make_tm()
        _with_adapter(tm)
        obj = _req("r")
        obj.lora_path = lora
        task = asyncio.create_task(_collect(tm, obj))
        if len(lora) > 1:
            with pytest.raises(RequestError, match="lora_path"):
                await task
            return
        while not sockets.requests():
            await asyncio.sleep(0.01)
        sent = sockets.requests()[0]
        assert sent.lora_id == lora[0]
        assert sent.extra_key == (None if lora[0] is None else "lora:a")
        task.cancel()

    run(body())


@pytest.mark.parametrize("batch", [False, True])
def test_the_servers_own_requests_reach_the_scheduler_marked(batch):
    """log_metrics false (the warm-up, /health_generate) stayed in the TokenizerManager: the
    scheduler's counters, the dashboard's, counted them."""

    async def body():
        tm, sockets = _make_tm()
        obj = GenerateReqInput(input_ids=[[5, 6], [7, 8]] if batch else [5, 6], log_metrics=False)
        task = asyncio.create_task(_collect(tm, obj))
        while len(sockets.requests()) < (2 if batch else 1):
            await asyncio.sleep(0.01)
        assert [r.log_metrics for r in sockets.requests()] == [False] * (2 if batch else 1)
        task.cancel()

    run(body())


def test_a_min_new_tokens_past_the_context_is_refused():
    """min_tokens 5000 with a 1024-token context ran to `length` after 1022 tokens, short of
    the minimum asked (vLLM refuses it)."""

    async def body():
        tm, sockets = _make_tm()  # (context 256, a prompt of 3)
        with pytest.raises(RequestError, match=r"min_new_tokens \(min_tokens\) 254 does not"):
            await _collect(tm, _req(min_new_tokens=254, max_new_tokens=None))
        assert sockets.requests() == []
        task = asyncio.create_task(_collect(tm, _req(min_new_tokens=253, max_new_tokens=None)))
        while not sockets.requests():
            await asyncio.sleep(0.01)
        task.cancel()

    run(body())


def _answer_control(sockets: FakeSockets, tm: TokenizerManager, success: bool = True) -> None:
    assert isinstance(sockets.sent[-1], UnloadLoRAAdapterReq)
    tm._dispatch(LoRAUpdateReqOutput(success, "" if success else "refused"))


async def _adapter_request_running() -> tuple[TokenizerManager, FakeSockets, asyncio.Task]:
    """A TokenizerManager serving adapter "a", and request "r" of it in flight."""
    tm, sockets = _make_tm()
    _with_adapter(tm)
    obj = _req("r")
    obj.lora_path = "a"
    running = asyncio.create_task(_collect(tm, obj))
    await _settle()
    return tm, sockets, running


def test_an_unload_refuses_new_requests_and_waits_for_those_in_flight():
    """The unload was refused while any request of the adapter was in flight, and requests
    kept being admitted meanwhile: under steady traffic it almost never passed (1 try in 366).
    As in SGLang, new requests are refused from its start, and it waits for the others."""

    async def body():
        tm, sockets, running = await _adapter_request_running()
        unload = asyncio.create_task(tm.unload_lora_adapter("a"))
        await asyncio.sleep(0.1)
        assert not unload.done()
        assert not any(isinstance(m, UnloadLoRAAdapterReq) for m in sockets.sent)
        late = _req("late")
        late.lora_path = "a"
        with pytest.raises(RequestError, match="unknown LoRA adapter 'a'"):
            await _collect(tm, late)
        await sockets.inbox.put(_output("r", "x", [1], LENGTH))
        assert (await running)["text"] == "x"
        for _ in range(100):
            if isinstance(sockets.sent[-1], UnloadLoRAAdapterReq):
                break
            await asyncio.sleep(0.01)
        _answer_control(sockets, tm)
        assert (await unload).success and "a" not in tm.lora_keys

    run(body())


def test_an_unload_waits_for_the_requests_whose_clients_left(monkeypatch):
    """A request whose client disconnected is still in the scheduler until its abort passes:
    the unload went ahead, and with --dp-size one replica unloaded while the other refused.
    Past the wait, the adapter stays loaded and the unload says why."""
    monkeypatch.setattr("radixserve.managers.tokenizer_manager.LORA_UNLOAD_WAIT_S", 0.2)

    async def body():
        tm, sockets, running = await _adapter_request_running()
        tm.abort_request("r")
        running.cancel()
        out = await tm.unload_lora_adapter("a")
        assert (
            not out.success and "1 requests still use LoRA adapter 'a' after 0.2 s" in out.message
        )
        assert not any(isinstance(m, UnloadLoRAAdapterReq) for m in sockets.sent)
        assert tm.lora_keys["a"] == "lora:a" and tm.lora_paths["a"] == "/adapters/a"

    run(body())


def test_an_unload_whose_client_leaves_while_it_waits_keeps_the_adapter():
    async def body():
        tm, _, running = await _adapter_request_running()
        unload = asyncio.create_task(tm.unload_lora_adapter("a"))
        await asyncio.sleep(0.05)
        assert "a" not in tm.lora_keys
        unload.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unload
        assert tm.lora_keys["a"] == "lora:a"
        running.cancel()

    run(body())


@pytest.mark.parametrize("op", ["unload", "load"])
def test_a_lora_update_some_replicas_refuse_is_undone_on_the_others(op, tmp_path):
    """Each data-parallel replica decides alone: one unloaded (or loaded) while another
    refused, the server said it failed, and the name was stuck: requests sent to one replica
    failed, and neither an unload nor a load of it was accepted again."""

    async def body():
        tm = _dp_tm()
        ctl, replicas = tm.dp_controller, tm.dp_controller.senders
        if op == "unload":
            _with_adapter(tm)
            call = asyncio.create_task(tm.unload_lora_adapter("a"))
        else:
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                (tmp_path / name).write_text("{}")  # only hashed: the schedulers are the test
            call = asyncio.create_task(tm.load_lora_adapter("a", str(tmp_path)))

        async def answer(*success: bool) -> Any:
            for _ in range(100):
                await asyncio.sleep(0.01)
                if all(s.sent for s in replicas):
                    break
            msgs = [s.sent.pop() for s in replicas]
            for msg, ok in zip(msgs, success, strict=True):
                ctl.on_reply(LoRAUpdateReqOutput(ok, "" if ok else "refused", call_id=msg.call_id))
            return msgs[0]

        first = await answer(True, False)
        undo = await answer(True, True)
        out = await call
        assert not out.success and out.message == "refused"
        if op == "unload":
            assert isinstance(first, UnloadLoRAAdapterReq) and not first.restore
            assert isinstance(undo, LoadLoRAAdapterReq) and undo.restore
            assert (undo.lora_name, undo.lora_path) == ("a", "/adapters/a")
            assert "a" in tm.lora_keys
        else:
            assert isinstance(first, LoadLoRAAdapterReq) and not first.restore
            assert isinstance(undo, UnloadLoRAAdapterReq) and undo.restore
            assert "a" not in tm.lora_keys

    run(body())


def test_the_latency_counts_the_checks_before_dispatch():
    """A request's clock started when it was dispatched: the tokenizing and the grammar check
    before it (seconds for a large schema) were in no e2e_latency or TTFT."""

    async def body():
        tm, sockets = _make_tm()
        check = tm.tokenize_and_check

        async def slow_check(obj, *args):
            await asyncio.sleep(0.3)
            return await check(obj, *args)

        tm.tokenize_and_check = slow_check
        task = asyncio.create_task(_collect(tm, _req("r")))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if sockets.requests():
                break
        await sockets.inbox.put(_output("r", "hi", [1], LENGTH))
        out = await task
        assert out["meta_info"]["e2e_latency"] >= 0.3

    run(body())


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized():
    """A 4 MB prompt was tokenized on the serving loop (8 s in which no other request was
    served) only to be refused for its length; 50 MB took the server's memory. Past what any
    tokenization could fit (the context times the longest token's characters) it is refused
    unread; up to it, it is tokenized and measured as before."""

    class Counting(ByteTokenizer):
        calls = 0

        def get_vocab(self) -> dict[str, int]:
            return {"ab": 0, "abcd": 1}  # (the longest token: 4 characters)

        def apply_chat_template(self, messages: list, **_: Any) -> str:
            return "".join(m["content"] for m in messages)

        def encode(self, text: str, **kw: Any) -> list[int]:
            Counting.calls += 1
            return super().encode(text, **kw)

    tm, _ = _make_tm()
    tm.tokenizer = Counting()
    with pytest.raises(RequestError, match="characters: more than the 256 tokens"):
        tm.tokenize_one(GenerateReqInput(text="x" * (256 * 4 * 4 + 1)))
    with pytest.raises(RequestError, match="characters"):
        tm.apply_chat_template([{"role": "user", "content": "x" * 5000}])
    assert Counting.calls == 0
    with pytest.raises(RequestError, match="context"):  # (measured: 300 tokens)
        tm.tokenize_one(GenerateReqInput(text="x" * 300))
    assert Counting.calls == 1


def test_a_load_on_a_server_without_lora_does_not_look_at_the_path(tmp_path):
    """Without --enable-lora the path was checked first: "not a directory" against "has no
    adapter_config.json" told any client (a web page, where no API key is set) what the
    server's disk holds."""
    from radixserve.lora.adapter import NO_LORA

    tm, sockets = _make_tm()
    for path in (str(tmp_path), str(tmp_path / "nope")):
        out = run(tm.load_lora_adapter("x", path))
        assert not out.success and out.message == NO_LORA
    assert sockets.sent == []
