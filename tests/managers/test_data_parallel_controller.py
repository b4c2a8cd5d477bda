"""The DataParallelController without processes: dispatch by each load-balance method, aborts
and control requests fanned out, replies merged, the prefix index bounded."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from radixserve.io_struct import (
    AbortReq,
    BatchStrOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    LoadLoRAAdapterReq,
    LoRAUpdateReqOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from radixserve.managers.data_parallel_controller import (
    BLOCK_TOKENS,
    DataParallelController,
    PrefixIndex,
    block_hashes,
    merge_server_infos,
)
from radixserve.sampling_params import SamplingParams


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False

    def send_pyobj(self, msg: Any) -> None:
        self.sent.append(msg)

    def close(self, linger: int | None = None) -> None:
        self.closed = True


def _controller(method: str, n: int = 2, **kw: Any) -> tuple[DataParallelController, list]:
    socks = [FakeSocket() for _ in range(n)]
    return DataParallelController(socks, method, **kw), socks


def _req(rid: str, ids: list[int], extra_key: str | None = None) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, None, ids, SamplingParams(), extra_key=extra_key)


def _finish(ctl: DataParallelController, *rids: str) -> None:
    n = len(rids)
    ctl.on_output(
        BatchStrOutput(
            list(rids), [{"type": "length"}] * n, [""] * n, [[]] * n, [1] * n, [1] * n, [0] * n
        )
    )


def _prefix(seed: int, n: int = 256) -> list[int]:
    return [(seed * 7919 + i * 31) % 300 + 3 for i in range(n)]


def test_round_robin_cycles_whatever_the_prompt():
    ctl, socks = _controller("round_robin", 3)
    ranks = [ctl.dispatch(_req(f"r{i}", _prefix(0))) for i in range(7)]
    assert ranks == [0, 1, 2, 0, 1, 2, 0]
    assert [len(s.sent) for s in socks] == [3, 2, 2]


def test_shortest_queue_counts_requests_in_flight():
    ctl, _ = _controller("shortest_queue")
    assert [ctl.dispatch(_req(r, [5])) for r in ("a", "b", "c")] == [0, 1, 0]
    _finish(ctl, "b")  # replica 1 is free again; replica 0 still has two
    assert ctl.loads == [2, 0]
    assert ctl.dispatch(_req("d", [5])) == 1
    _finish(ctl, "a", "c", "d")
    assert ctl.loads == [0, 0] and ctl.rid_to_rank == {}


def test_prefix_affinity_keeps_each_group_on_one_replica():
    ctl, _ = _controller("prefix_affinity")
    leaders = {g: ctl.dispatch(_req(f"g{g}", _prefix(g) + [1, 2])) for g in range(4)}
    assert sorted(leaders.values()) == [0, 0, 1, 1]  # new prefixes spread over the replicas
    for g in range(4):
        for q in range(5):
            rank = ctl.dispatch(_req(f"g{g}q{q}", _prefix(g) + [q + 10] * 20))
            assert rank == leaders[g], (g, q)


def test_prefix_affinity_needs_the_threshold_share_of_the_prompt():
    ctl, _ = _controller("prefix_affinity", cache_threshold=0.5)
    assert ctl.dispatch(_req("a", _prefix(1, 64))) == 0
    # 64 shared tokens of 160: under half, so the smaller index (replica 1) wins.
    assert ctl.dispatch(_req("b", _prefix(1, 64) + _prefix(2, 96))) == 1
    # 64 of 96: over half, the replica that holds them.
    assert ctl.dispatch(_req("c", _prefix(1, 64) + _prefix(3, 32))) == 0


def test_prefix_affinity_falls_back_to_the_least_loaded_when_imbalanced():
    ctl, _ = _controller("prefix_affinity", balance_abs_threshold=4, balance_rel_threshold=1.5)
    ranks = [ctl.dispatch(_req(f"r{i}", _prefix(0))) for i in range(8)]
    # The shared prefix pulls everything to replica 0 until it has 5 more than replica 1.
    assert ranks[:5] == [0] * 5 and ranks[5] == 1
    assert ctl.loads[0] - ctl.loads[1] <= 5


def test_prefix_affinity_sends_no_request_to_queue_beside_a_replica_with_room():
    """The shared prefix (or, without a match, the smaller index) won until 32 more requests
    were in flight on one replica than on the other, whatever --max-running-requests was: one
    replica queued while the other idled."""
    ctl, _ = _controller("prefix_affinity", max_running_requests=4)
    ranks = [ctl.dispatch(_req(f"r{i}", _prefix(0))) for i in range(8)]
    assert ranks == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ctl.dispatch(_req("r8", _prefix(0))) == 0  # both full: the cache decides again


def test_prefix_affinity_sends_prompts_shorter_than_a_block_to_the_least_loaded():
    """Such a prompt enters no index: every one went to the replica with the smaller index."""
    ctl, _ = _controller("prefix_affinity")
    assert ctl.dispatch(_req("long", _prefix(0))) == 0
    assert [ctl.dispatch(_req(f"s{i}", [7, 8, 9])) for i in range(5)] == [1, 0, 1, 0, 1]


def test_extra_key_namespaces_the_index():
    ctl, _ = _controller("prefix_affinity")
    assert ctl.dispatch(_req("a", _prefix(0), extra_key="lora-a")) == 0
    assert ctl.dispatch(_req("b", _prefix(0), extra_key="lora-b")) == 1
    assert ctl.dispatch(_req("c", _prefix(0), extra_key="lora-a")) == 0


def test_prefix_index_is_bounded_and_evicts_leaves_first():
    index = PrefixIndex(capacity_tokens=8 * BLOCK_TOKENS)
    shared = block_hashes(_prefix(0, 4 * BLOCK_TOKENS))
    a = block_hashes(_prefix(0, 4 * BLOCK_TOKENS) + _prefix(1, 4 * BLOCK_TOKENS))
    b = block_hashes(_prefix(0, 4 * BLOCK_TOKENS) + _prefix(2, 4 * BLOCK_TOKENS))
    index.insert(a)
    index.insert(b)  # 12 blocks into 8: a's own blocks go, the shared prefix stays
    assert len(index.blocks) == 8
    assert index.match(b) == 8 * BLOCK_TOKENS
    assert index.match(a) == 4 * BLOCK_TOKENS == index.match(shared)
    assert block_hashes(list(range(BLOCK_TOKENS - 1))) == []  # no full block, nothing indexed


def test_aborts_go_to_the_owner_and_abort_all_everywhere():
    ctl, socks = _controller("round_robin")
    ctl.dispatch(_req("a", [5]))
    ctl.dispatch(_req("b", [5]))
    for s in socks:
        s.sent.clear()
    ctl.send_pyobj(AbortReq("b"))
    assert socks[0].sent == [] and socks[1].sent == [AbortReq("b")]
    ctl.send_pyobj(AbortReq("", abort_all=True))
    ctl.send_pyobj(AbortReq("unknown"))  # finished already, or never ours: everyone checks
    assert all(s.sent[-2:] == [AbortReq("", True), AbortReq("unknown")] for s in socks)
    ctl.close(linger=0)
    assert all(s.closed for s in socks)


def _info(rank: int, **kw: Any) -> dict[str, Any]:
    base = {
        "dp_rank": rank,
        "running": 1,
        "queued": rank,
        "max_total_num_tokens": 100,
        "available_tokens": 60,
        "evictable_tokens": 20,
        "token_usage": 0.2,
        "new_token_ratio": 0.5 + rank * 0.2,
        "cached_tokens": 10 * (rank + 1),
        "spec_step_cost_ms": {"verify": rank},
    }
    return {**base, **kw}


def test_merge_server_infos_sums_and_lists_the_replicas():
    merged = merge_server_infos([_info(1), _info(0)])
    assert merged["running"] == 2 and merged["queued"] == 1 and merged["cached_tokens"] == 30
    assert merged["max_total_num_tokens"] == 200
    assert merged["token_usage"] == pytest.approx(0.2)
    assert merged["new_token_ratio"] == pytest.approx(0.6)
    assert merged["spec_step_cost_ms"] == {"verify": 0}  # not a number: replica 0's
    assert "dp_rank" not in merged
    assert [r["dp_rank"] for r in merged["replicas"]] == [0, 1]


def test_server_info_keeps_the_launch_arguments_per_replica():
    """The replicas' summed max_running_requests overwrote the argument of that name in
    /get_server_info: 16 for --max-running-requests 8 --dp-size 2. The sum, the server's
    capacity, is a key of its own; the dashboard's "of N" reads the merged figure itself."""
    from radixserve.args import ServerArgs
    from radixserve.entrypoints.engine import server_info_view

    args = ServerArgs(max_running_requests=8, max_total_tokens=100, dp_size=2)
    merged = merge_server_infos([_info(r, max_running_requests=8) for r in (0, 1)])
    assert merged["max_running_requests"] == 16  # (the dashboard's whole-server figure)
    view = server_info_view(args, merged)
    assert view["max_running_requests"] == 8 and view["max_running_requests_total"] == 16
    assert view["max_total_tokens"] == 100 and view["max_total_num_tokens"] == 200
    auto = server_info_view(dataclasses.replace(args, max_running_requests=None), merged)
    assert auto["max_running_requests"] == 8  # the resolved "auto", per replica


def test_the_shared_storage_tier_is_counted_once():
    """The replicas count one storage directory: 24 blocks on disk read 48 with two. Each lists
    it at its own moment (blocks written since replica 0's listing were missing): the freshest
    count, the largest, is the server's."""
    infos = [{**_info(r), "hicache_storage_blocks": 24} for r in (0, 1)]
    assert merge_server_infos(infos)["hicache_storage_blocks"] == 24
    infos[1]["hicache_storage_blocks"] = 26
    assert merge_server_infos(infos)["hicache_storage_blocks"] == 26


def _reply(socks, reply):
    """`reply` to the last control request broadcast (its call id echoed, as a scheduler's)."""
    reply.call_id = socks[0].sent[-1].call_id
    return reply


def test_control_fans_out_merges_and_shares_one_broadcast():
    async def run() -> None:
        ctl, socks = _controller("round_robin")
        calls = [
            asyncio.ensure_future(ctl.control(GetServerInfoReq(), GetServerInfoReqOutput, 5))
            for _ in range(3)
        ]
        await asyncio.sleep(0)
        assert [len(s.sent) for s in socks] == [1, 1]  # one broadcast for the three calls
        ctl.on_reply(_reply(socks, GetServerInfoReqOutput(_info(1))))
        assert not any(c.done() for c in calls)
        ctl.on_reply(_reply(socks, GetServerInfoReqOutput(_info(0))))
        outs = await asyncio.gather(*calls)
        assert all(o.info["running"] == 2 for o in outs)

        flush = asyncio.ensure_future(ctl.control(FlushCacheReq(), FlushCacheReqOutput, 5))
        await asyncio.sleep(0)
        ctl.on_reply(_reply(socks, FlushCacheReqOutput(True)))
        ctl.on_reply(_reply(socks, FlushCacheReqOutput(False, "requests are running")))
        out = await flush
        assert not out.success and out.message == "requests are running"

    asyncio.run(run())


def test_a_late_reply_to_a_call_that_timed_out_answers_no_later_call():
    """A replica that answered a timed-out call late had its reply counted for the next call
    of that kind: a flush reported done while another replica had neither flushed nor
    answered, /get_load listed one rank twice. And the first of two callers sharing a call to
    give up took the call away from the other, whose replies then arrived for nobody."""

    async def run() -> None:
        ctl, socks = _controller("round_robin")
        with pytest.raises(asyncio.TimeoutError):
            await ctl.control(FlushCacheReq(), FlushCacheReqOutput, 0.01)
        stale = _reply(socks, FlushCacheReqOutput(True))  # replica 0 answers, too late
        flush = asyncio.ensure_future(ctl.control(FlushCacheReq(), FlushCacheReqOutput, 5))
        await asyncio.sleep(0)
        ctl.on_reply(stale)
        ctl.on_reply(_reply(socks, FlushCacheReqOutput(True)))  # replica 1's to the new call
        await asyncio.sleep(0)
        assert not flush.done()  # replica 0 has not answered this call
        ctl.on_reply(_reply(socks, FlushCacheReqOutput(True)))
        assert (await flush).success

        short = asyncio.ensure_future(ctl.control(GetServerInfoReq(), GetServerInfoReqOutput, 0.05))
        long = asyncio.ensure_future(ctl.control(GetServerInfoReq(), GetServerInfoReqOutput, 5))
        with pytest.raises(asyncio.TimeoutError):
            await short
        ctl.on_reply(_reply(socks, GetServerInfoReqOutput(_info(0))))
        ctl.on_reply(_reply(socks, GetServerInfoReqOutput(_info(1))))
        assert [r["dp_rank"] for r in (await long).info["replicas"]] == [0, 1]

    asyncio.run(run())


def test_lora_loads_and_unloads_are_each_their_own_call():
    """They share a reply type: an unload made while a load was in flight took the load's
    answer and was never sent."""

    async def run() -> None:
        ctl, socks = _controller("round_robin")
        load = asyncio.ensure_future(
            ctl.control(LoadLoRAAdapterReq("a", "/a"), LoRAUpdateReqOutput, 5)
        )
        await asyncio.sleep(0)
        load_id = socks[0].sent[-1].call_id
        unload = asyncio.ensure_future(
            ctl.control(UnloadLoRAAdapterReq("b"), LoRAUpdateReqOutput, 5)
        )
        await asyncio.sleep(0)
        assert [type(m).__name__ for m in socks[0].sent] == [
            "LoadLoRAAdapterReq",
            "UnloadLoRAAdapterReq",
        ]
        for _ in range(2):
            ctl.on_reply(_reply(socks, LoRAUpdateReqOutput(False, "no adapter named 'b'")))
            ctl.on_reply(LoRAUpdateReqOutput(True, call_id=load_id))
        assert (await load).success and not (await unload).success

    asyncio.run(run())


def test_a_successful_flush_empties_the_prefix_indexes():
    async def run() -> None:
        ctl, socks = _controller("prefix_affinity")
        ctl.dispatch(_req("a", _prefix(0)))
        assert ctl.indexes[0].blocks
        flush = asyncio.ensure_future(ctl.control(FlushCacheReq(), FlushCacheReqOutput, 5))
        await asyncio.sleep(0)
        ctl.on_reply(_reply(socks, FlushCacheReqOutput(True)))
        ctl.on_reply(_reply(socks, FlushCacheReqOutput(True)))
        assert (await flush).success
        assert not ctl.indexes[0].blocks

    asyncio.run(run())


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="load balance method"):
        DataParallelController([FakeSocket()], "random")


def test_dp_flags():
    import argparse

    from radixserve.args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--dp", "2", "--load-balance-method", "shortest_queue"])
    assert (ns.dp_size, ns.load_balance_method) == (2, "shortest_queue")
    assert ServerArgs().load_balance_method == "prefix_affinity"
    with pytest.raises(ValueError, match="--dp-size must be >= 1"):
        ServerArgs(dp_size=0)
    with pytest.raises(ValueError, match="not supported yet"):
        ServerArgs(dp_size=2, tp_size=2)
    with pytest.raises(ValueError, match="load-balance-method"):
        ServerArgs(load_balance_method="random")


def test_the_watchdog_sees_the_most_silent_replica():
    import time
    from types import SimpleNamespace

    from radixserve.entrypoints.engine import Subprocesses

    now = time.monotonic()
    procs = SimpleNamespace(
        heartbeats=[SimpleNamespace(value=now), SimpleNamespace(value=now - 60)]
    )
    assert Subprocesses.seconds_since_heartbeat(procs) >= 60  # replica 1 is stuck
    procs.detokenizer = None  # (the stuck one is named: "the scheduler has been stuck" was all)
    procs.seconds_since_heartbeat = lambda: Subprocesses.seconds_since_heartbeat(procs)
    name, silent = Subprocesses.silent_child(procs)
    assert name == "scheduler of data-parallel replica 1" and silent >= 60


@pytest.mark.parametrize("method", ["prefix_affinity", "round_robin", "shortest_queue"])
def test_a_request_naming_its_replica_goes_there(method):
    dp, socks = _controller(method)
    ids = list(range(3 * BLOCK_TOKENS))
    for i, rank in enumerate([1, 1, 0, 1]):
        req = _req(f"r{i}", ids if rank == 1 else ids[::-1])
        req.data_parallel_rank = rank
        assert dp.dispatch(req) == rank
    assert [len(s.sent) for s in socks] == [1, 3]
    if method == "prefix_affinity":  # replica 1 holds the prefix now: an unnamed one follows
        assert dp.dispatch(_req("free", ids)) == 1


def test_replicas_split_the_cpus_and_say_when_they_must_share_them(monkeypatch, caplog):
    from radixserve.managers.data_parallel_controller import replica_cpus

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert replica_cpus(2) == [[0, 1], [2, 3]]
    assert not caplog.records
    assert replica_cpus(8) == [None] * 8
    assert "--dp-size 8 on 4 CPUs" in caplog.text


def _replica_snapshot(rank: int, clock: list[float]) -> dict[str, Any]:
    """A dashboard snapshot as a replica's scheduler makes it (real LiveStats, fake steps)."""
    from types import SimpleNamespace

    from radixserve.managers.live_stats import LiveStats

    live = LiveStats(clock=lambda: clock[0])
    decode = SimpleNamespace(is_decode=lambda: True)
    for step in range(3):
        clock[0] = 1000.0 + step + rank / 10
        batch = SimpleNamespace(input_ids=[0] * 4, decoding_reqs=[], forward_mode=decode, reqs=[1])
        stats = SimpleNamespace(
            prompt_tokens=100 * (rank + 1), cached_tokens=50, generation_tokens=4 * (step + 1)
        )
        live.on_step(batch, stats)
    row = {"tokens": 40 + rank, "leaves": 3 - rank, "hits": 1, "locks": 0, "extra_key": None}
    tree = {
        "nodes": 5,
        "depth": 2 + rank,
        "depth_tokens": 90,
        "leaves": 3,
        "truncated": rank == 1,
        "top_prefixes": [{**row, "head_ids": [rank], "tail_ids": []}],
    }
    return {**_info(rank), **live.snapshot(), "tree": tree}


def test_the_dashboard_views_of_the_replicas_are_merged():
    """The steps, tokens per second and tree of every replica, not replica 0's alone (its
    throughput read half the server's with two replicas)."""
    clock = [0.0]
    infos = [_replica_snapshot(r, clock) for r in (0, 1)]
    merged = merge_server_infos(infos)
    throughput = merged["throughput"]
    assert throughput["generation_tps"] == pytest.approx(
        2 * infos[0]["throughput"]["generation_tps"]
    )
    assert throughput["prompt_tps"] == pytest.approx(300 / throughput["rate_window_s"])
    assert throughput["series"]["t"] == [1000, 1001, 1002]
    assert throughput["series"]["generation"] == [8, 8, 8]
    assert throughput["window_hit_rate"] == pytest.approx(100 / 300)
    steps = merged["steps"]
    assert steps["t"] == sorted(steps["t"]) and len(steps["t"]) == 6
    assert steps["replica"] == [0, 1, 0, 1, 0, 1] and steps["mode"] == ["decode"] * 6
    tree = merged["tree"]
    assert (tree["nodes"], tree["leaves"], tree["depth"], tree["truncated"]) == (10, 6, 3, True)
    assert [(p["replica"], p["head_ids"]) for p in tree["top_prefixes"]] == [(0, [0]), (1, [1])]


def test_cpu_replicas_share_the_hosts_memory_fraction(monkeypatch):
    """Each CPU replica sized its KV pool to the whole --mem-fraction-static of the memory
    available (about 3.4 GiB each here): --dp-size 5 asked for all of it."""
    from radixserve.args import ServerArgs
    from radixserve.managers import data_parallel_controller, scheduler_process

    seen = []
    monkeypatch.setattr(
        scheduler_process, "run_scheduler_process", lambda args, *a, **k: seen.append(args)
    )
    args = ServerArgs(device="cpu", dp_size=4, mem_fraction_static=0.2)
    for rank in range(4):
        data_parallel_controller.run_replica_process(args, None, None, None, rank, None)
    assert [a.mem_fraction_static for a in seen] == [pytest.approx(0.05)] * 4


def test_each_replica_samples_its_own_random_numbers(tiny_llama_dir):
    """Every replica seeded torch with --random-seed: replicas that had drawn as often
    sampled the same tokens for the same prompt, and a request's n > 1 choices spread over two
    replicas came back in identical pairs."""
    import torch

    from radixserve.args import ServerArgs
    from radixserve.managers.scheduler import Scheduler

    args = ServerArgs(
        model_path=tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=512
    ).resolve()

    def sample(dp_rank: int) -> list[int]:
        outputs: list[Any] = []
        scheduler = Scheduler(args, outputs.append, dp_rank=dp_rank)
        params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
        scheduler.process_input_requests([TokenizedGenerateReqInput("r", None, [5, 6], params)])
        while scheduler.has_work():
            scheduler.step()
        return [t for out in outputs for ids in out.output_ids for t in ids]

    torch.manual_seed(123)  # (what ran before must not matter: each replica seeds afresh)
    first = sample(0)
    assert len(first) == 12 and sample(0) == first
    assert sample(1) != first


def test_the_cache_hit_rate_of_the_replicas_is_weighed_by_their_prompts():
    """It was the plain mean of the replicas' rates: with all traffic on one replica (a shared
    prefix under prefix_affinity), the server's rate read half of it."""
    from types import SimpleNamespace

    from radixserve.managers.live_stats import LiveStats

    infos = []
    for rank, (prompt, cached) in enumerate(((400, 300), (0, 0), (100, 0))):
        live = LiveStats(clock=lambda: 1000.0)
        live.on_step(
            None, SimpleNamespace(prompt_tokens=prompt, cached_tokens=cached, generation_tokens=1)
        )
        infos.append({**_info(rank), **live.rates()})
    assert [i["cache_hit_rate"] for i in infos] == [0.75, None, 0.0]
    assert merge_server_infos(infos)["cache_hit_rate"] == pytest.approx(300 / 500)
