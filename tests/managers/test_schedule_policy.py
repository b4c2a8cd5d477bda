"""PrefillAdder budgets, the new_token_ratio tracker, retraction order and policy orders."""

from __future__ import annotations

import pytest
from rs_fake_worker import FakeWorker, expected_output

from radixserve.args import ServerArgs
from radixserve.io_struct import TokenizedGenerateReqInput
from radixserve.managers.schedule_batch import Req
from radixserve.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from radixserve.managers.scheduler import Scheduler
from radixserve.managers.scheduler_stats import NewTokenRatioTracker
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey
from radixserve.sampling_params import SamplingParams


def _req(
    rid: str, n_in: int, max_new: int, out: int = 0, ignore_eos: bool = False, base: int = 3
) -> Req:
    r = Req(
        rid,
        [base + i % 50 for i in range(n_in)],
        SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos),
    )
    r.output_ids = [5] * out
    return r


def _pools(total: int = 1000):
    rtp = ReqToTokenPool(16, 2048)
    alloc = TokenToKVPoolAllocator(total)
    return rtp, alloc, RadixCache(rtp, alloc)


def test_reservation_uses_ratio_and_clip():
    _, alloc, cache = _pools()
    running = [
        _req("a", 10, 100, out=20),
        _req("b", 10, 10_000),
        _req("c", 10, 50, ignore_eos=True),
    ]
    adder = PrefillAdder(cache, alloc, running, 0.5, 4096, None, 16)
    # a: (100-20)*0.5, b: clip 4096*0.5, c: ignore_eos -> ratio 1: 50
    assert adder.reserved == pytest.approx(40 + 2048 + 50)
    assert adder.rem_total_tokens == pytest.approx(1000 - 2138)


def test_add_one_req_budgets():
    _, alloc, cache = _pools(1000)
    running = [_req("run", 10, 200)]  # reserves 200 * 0.5 = 100
    adder = PrefillAdder(cache, alloc, running, 0.5, 300, None, 16)
    r1 = _req("r1", 200, 100)
    r1.init_next_round_input(cache)
    assert adder.add_one_req(r1) == AddReqResult.CONTINUE  # 200 + 50 <= 900
    assert adder.rem_input_tokens == 100
    assert adder.reserved == pytest.approx(100 + 250)
    r2 = _req("r2", 150, 10)
    r2.init_next_round_input(cache)
    assert adder.add_one_req(r2) == AddReqResult.OTHER  # input budget 100 < 150
    r3 = _req("r3", 90, 2000)
    r3.init_next_round_input(cache)
    assert adder.add_one_req(r3) == AddReqResult.NO_TOKEN  # 90 + 1000 > 650


def test_add_one_req_chunks_long_prompt():
    _, alloc, cache = _pools(1000)
    adder = PrefillAdder(cache, alloc, [], 0.5, 4096, 64, 16)
    r = _req("long", 200, 10)
    r.init_next_round_input(cache)
    assert adder.add_one_req(r) == AddReqResult.OTHER
    assert adder.new_chunked_req is r
    assert r.extend_input_len == 64 and len(r.fill_ids) == 64


def test_locking_the_prefix_is_rechecked():
    """The matched prefix becomes protected while admitted, so it no longer counts as free."""
    rtp, alloc, cache = _pools(300)
    slots = alloc.alloc(200)
    cache.insert(RadixKey([3 + i % 50 for i in range(200)]), slots)
    assert cache.evictable_size() == 200
    r = _req("p", 260, 10)
    r.init_next_round_input(cache)
    assert len(r.prefix_indices) == 200
    adder = PrefillAdder(cache, alloc, [_req("x", 5, 10)], 1.0, 4096, None, 16)
    # before the lock: 100 free + 200 evictable - 10 reserved = 290 >= 60 + 10
    assert adder.add_one_req(r) == AddReqResult.CONTINUE
    assert cache.protected_size() == 200 and r.cache_protected_len == 200
    assert adder.rem_total_tokens == pytest.approx(100 - 10 - 70)


def test_new_token_ratio_tracker():
    t = NewTokenRatioTracker(1.0)
    assert t.value == pytest.approx(0.7)
    assert t.min == pytest.approx(0.7 * 0.14)
    t.on_decode_step()
    assert t.value == pytest.approx(0.7 - (0.7 - 0.098) / 600)
    for _ in range(1000):
        t.on_decode_step()
    assert t.value == pytest.approx(0.098)
    reqs = [_req("a", 5, 100, out=30), _req("b", 5, 50, out=10)]
    t.on_retract(reqs)
    assert t.value == pytest.approx((40 + 40) / 151)
    assert NewTokenRatioTracker(2.0).value == 1.0


def test_retraction_order_fewest_outputs_then_longest_input():
    worker = FakeWorker(total_tokens=1000, max_running=8)
    s = Scheduler(ServerArgs(device="cpu", dtype="float32").resolve(), lambda m: None, None, worker)
    reqs = [
        _req("few-short", 10, 100, out=2),
        _req("few-long", 40, 100, out=2),
        _req("many", 10, 100, out=9),
    ]
    for r in reqs:
        r.init_next_round_input(s.tree_cache)
    batch = s._new_batch(reqs)
    batch.prepare_for_extend()
    order = []
    batch.retract_decode(lambda remaining: order.append(len(remaining)) or len(remaining) <= 1)
    assert [r.rid for r in batch.reqs] == ["many"]
    assert s.allocator.available_size() + s.tree_cache.evictable_size() >= 1000 - (10 + 9)
    for r in reqs[:2]:
        assert r.req_pool_idx is None and r.kv_committed_len == 0 and r.num_retractions == 1


def test_retraction_under_a_tiny_pool_keeps_outputs_exact():
    worker = FakeWorker(total_tokens=160, max_running=8)
    args = ServerArgs(
        device="cpu", dtype="float32", schedule_conservativeness=0.05, enable_integrity_checks=True
    ).resolve()
    s = Scheduler(args, lambda m: outs.append(m), None, worker)
    outs: list = []
    prompts = {f"r{i}": [3 + (i * 5 + j) % 90 for j in range(12)] for i in range(6)}
    for rid, p in prompts.items():
        sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        s.process_input_requests([TokenizedGenerateReqInput(rid, None, p, sp)])
    for _ in range(2000):
        if not s.has_work():
            break
        s.step()
    assert s.stats.num_retractions > 0
    got: dict[str, list[int]] = {}
    for m in outs:
        for rid, ids in zip(m.rids, m.output_ids, strict=True):
            got.setdefault(rid, []).extend(ids)
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, 30)
    s.assert_drained()


def test_request_larger_than_pool_is_rejected_and_scheduler_keeps_running():
    worker = FakeWorker(total_tokens=64, max_running=4)
    outs: list = []
    s = Scheduler(ServerArgs(device="cpu", dtype="float32").resolve(), outs.append, None, worker)
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    s.process_input_requests([TokenizedGenerateReqInput("big", None, [3] * 100, sp)])
    reason = outs[0].finished_reasons[0]
    assert reason["type"] == "abort" and "KV cache" in reason["message"]
    s.process_input_requests(
        [
            TokenizedGenerateReqInput(
                "ok", None, [4] * 10, SamplingParams(max_new_tokens=5, ignore_eos=True)
            )
        ]
    )
    while s.has_work():
        s.step()
    assert outs[-1].rids == ["ok"] and outs[-1].finished_reasons[0]["type"] == "length"
    s.assert_drained()


@pytest.mark.parametrize("max_new", [200, None])
def test_a_request_longer_than_the_pool_ends_by_length_where_it_fills_it(max_new):
    """Its output is capped at what the pool holds for one request (SGLang's max_req_len):
    it was aborted as "no longer fits" once it had filled the pool."""
    worker = FakeWorker(total_tokens=64, max_running=4)
    outs: list = []
    s = Scheduler(ServerArgs(device="cpu", dtype="float32").resolve(), outs.append, None, worker)
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    s.process_input_requests([TokenizedGenerateReqInput("grow", None, [3] * 40, sp)])
    while s.has_work():
        s.step()
    assert outs[-1].finished_reasons[0] == {"type": "length", "length": 25}
    assert sum(len(o.output_ids[0]) for o in outs) == 25
    s.assert_drained()


def _policy_order(policy: str, reqs: list[Req], cache) -> list[str]:
    p = SchedulePolicy(policy, cache)
    q = list(reqs)
    p.calc_priority(q)
    return [r.rid for r in q]


def test_policy_orders():
    _, alloc, cache = _pools(2000)
    shared = [7] * 100
    cache.insert(RadixKey(shared), alloc.alloc(100))
    a = Req("a", [9] * 20, SamplingParams(max_new_tokens=5))
    b = Req("b", shared + [4] * 5, SamplingParams(max_new_tokens=50))
    c = Req("c", shared[:50] + [5] * 5, SamplingParams(max_new_tokens=10), priority=5)
    assert _policy_order("fcfs", [a, b, c], cache) == ["a", "b", "c"]
    assert _policy_order("lpm", [a, b, c], cache) == ["b", "c", "a"]
    assert _policy_order("lof", [a, b, c], cache) == ["b", "c", "a"]
    assert _policy_order("priority", [a, b, c], cache)[0] == "c"
    assert sorted(_policy_order("random", [a, b, c], cache)) == ["a", "b", "c"]
    d = Req("d", shared + [6] * 5, SamplingParams(max_new_tokens=10))
    # b, c and d sit under the shared prefix (the heavier subtree); a matches nothing.
    order = _policy_order("dfs-weight", [a, b, c, d], cache)
    assert order[-1] == "a" and set(order[:3]) == {"b", "c", "d"}


def test_lpm_falls_back_to_fcfs_for_long_queues_and_without_cache():
    _, alloc, cache = _pools()
    p = SchedulePolicy("lpm", cache)
    assert p.effective_policy(129) == "fcfs" and p.effective_policy(128) == "lpm"

    class Disabled:
        disabled = True

    assert SchedulePolicy("lpm", Disabled()).policy == "fcfs"


def test_in_batch_prefix_caching_holds_back_duplicates():
    _, alloc, cache = _pools()
    prefix = [11] * 64
    reqs = [Req(f"g{i}", prefix + [20 + i] * 8, SamplingParams()) for i in range(4)]
    other = Req("solo", [30] * 40, SamplingParams())
    p = SchedulePolicy("lpm", cache)
    q = reqs + [other]
    order = p.calc_priority(q)
    assert order.held == {"g1", "g2", "g3"} and order.matched
    assert [r.rid for r in q][:2] == ["g0", "solo"]
