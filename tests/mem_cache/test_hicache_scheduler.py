"""The hierarchical cache inside the real Scheduler, over the fake worker (whose "KV" is the
token id and position written at each slot, and whose every step checks that a request's row
points at the right KV): multi-turn prefixes far beyond the device pool are demoted to the
host and loaded back, outputs stay exact, nothing leaks in any tier (integrity checks on)."""

from __future__ import annotations

import errno
import os
import random
import types

import pytest
from rs_fake_worker import FakeRun, expected_output
from rs_testing import file_storage_flags

from radixserve.io_struct import FlushCacheReq, FlushCacheReqOutput

DEVICE_TOKENS = 512


def _conversations(n: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """n conversations; turn t's prompt is turn t-1's prompt plus 80 new tokens."""
    rng = random.Random(seed)
    convs = []
    for _ in range(n):
        prompt, turns_of = [], []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(3, 97) for _ in range(80)]
            turns_of.append(list(prompt))
        convs.append(turns_of)
    return convs


def _run(overlap: bool, **flags) -> tuple[FakeRun, dict[str, int]]:
    run = FakeRun(
        total_tokens=DEVICE_TOKENS,
        max_running=4,
        overlap=overlap,
        chunked_prefill_size=256,
        **flags,
    )
    convs = _conversations(6, 4)
    cached: dict[str, int] = {}
    for t in range(4):  # round-robin over conversations: each one's prefix is evicted between
        for c, conv in enumerate(convs):
            rid = f"c{c}t{t}"
            run.submit(rid, conv[t], max_new=8)
            run.drain()
    got = run.tokens()
    for c, conv in enumerate(convs):
        for t in range(4):
            assert got[f"c{c}t{t}"] == expected_output(conv[t], 8), f"c{c}t{t}"
    for msg in run.outs:
        for rid, n in zip(msg.rids, msg.cached_tokens, strict=True):
            cached[rid] = n
    return run, cached


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_tier_serves_prefixes_evicted_from_the_device(policy, overlap):
    base, base_cached = _run(overlap)
    hi, hi_cached = _run(overlap, enable_hierarchical_cache=True, hicache_write_policy=policy)
    # 6 conversations × up to 320 tokens ≈ 4× the device pool: the plain cache loses them.
    assert sum(hi_cached.values()) > 2 * sum(base_cached.values())
    info = hi.s.get_server_info()
    assert info["hicache_host_hit_tokens"] > 0
    assert info["hicache_device_to_host_tokens"] > 0
    hi.s.hicache.check_integrity()
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]


def _hold_copies(run: FakeRun):
    """Make the cache controller's copy thread wait until the returned event is set."""
    import threading

    gate = threading.Event()
    ctrl = run.s.hicache.controller
    copy = ctrl._copy

    def gated(op):
        gate.wait(10)
        return copy(op)  # (a storage write's next stage)

    ctrl.copier.run = gated
    return gate


def test_a_slow_storage_tier_holds_no_device_slots(tmp_path):
    """A storage write read its blocks off the device on the storage thread, between disk
    writes, and kept the request's device slots locked until the last was on disk: with a slow
    disk the pool filled with finished, locked prefixes and new requests waited for the disk
    (24 requests: 6.8 s and 1,200 steps instead of 0.06 s). The bytes are read off the device
    first now, and the slots let go."""
    import threading

    run = FakeRun(total_tokens=512, max_running=4, **file_storage_flags(tmp_path))
    gate = threading.Event()
    store = run.s.hicache.controller._store

    def slow_disk(op):
        gate.wait(10)
        return store(op)

    run.s.hicache.controller.storer.run = slow_disk
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(3, 97) for _ in range(200)] for i in range(6)}
    for rid, prompt in prompts.items():
        run.submit(rid, prompt, max_new=4)
    for _ in range(400):  # (bounded) every request ends while the disk writes nothing
        if len(run.reasons()) == len(prompts):
            break
        run.step()
    assert {rid: run.tokens()[rid] for rid in prompts} == {
        rid: expected_output(p, 4) for rid, p in prompts.items()
    }
    writes = [op for op in run.s.hicache.ops if op.kind == "storage_write"]
    assert writes and not any(op.done.is_set() for op in writes)
    for op in writes:  # (the copy thread reads them off the device; a loaded machine is slow)
        assert op.device_read.wait(30)
    run.s.hicache.poll()
    assert run.s.tree_cache.protected_size() == 0  # the disk still has them all to write
    assert not any(op.done.is_set() for op in writes)
    gate.set()
    run.drain()
    assert run.s.get_server_info()["hicache_storage_write_tokens"] > 0
    run.s.close()


def test_a_flush_right_after_a_run_waits_for_the_cache_copies(tmp_path, monkeypatch):
    """The last request finished, its KV still being written to the host and storage: the flush
    was refused as "requests are running" (a benchmark flushing between runs got a 400). It
    waits for the copies now; copies that do not land in time are named."""
    from radixserve.managers import scheduler

    run = FakeRun(total_tokens=512, max_running=4, **file_storage_flags(tmp_path))
    gate = _hold_copies(run)
    run.submit("a", [random.Random(1).randrange(3, 97) for _ in range(200)], max_new=4)
    while "a" not in run.reasons() or run.s.has_work(cache_copies=False):
        run.step()
    assert run.s.hicache.has_pending()

    def answer() -> FlushCacheReqOutput | None:
        replies = [o for o in run.outs if isinstance(o, FlushCacheReqOutput)]
        for reply in replies:
            run.outs.remove(reply)
        return replies[0] if replies else None

    def flush() -> FlushCacheReqOutput:
        run.s.process_input_requests([FlushCacheReq()])
        for _ in range(2000):
            reply = answer()
            if reply is not None:
                return reply
            run.step()
        raise AssertionError("the flush was never answered")

    monkeypatch.setattr(scheduler, "FLUSH_WAIT_S", 0.2)
    out = flush()
    assert not out.success and "copies are in flight" in out.message
    # The flush waits in the scheduler, not in its loop (a slow disk held every request and
    # the answer for 30 s): the loop steps meanwhile, and the answer comes once they land.
    monkeypatch.setattr(scheduler, "FLUSH_WAIT_S", 30.0)
    run.s.process_input_requests([FlushCacheReq()])
    for _ in range(3):
        run.step()
    assert answer() is None
    gate.set()
    assert flush().success
    assert not run.s.hicache.has_pending()
    run.s.close()


def _fill_then_evict(run: FakeRun, prompt: list[int]) -> None:
    """Run prompt, then enough other prompts that its prefix is demoted to the host."""
    run.submit("first", prompt, max_new=4)
    run.drain()
    rng = random.Random(7)
    for i in range(4):
        run.submit(f"filler{i}", [rng.randrange(3, 97) for _ in range(200)], max_new=4)
        run.drain()
    assert run.s.hicache.match_prefix(_key(prompt)).device_indices.numel() == 0


def _key(prompt):
    from radixserve.mem_cache.radix_cache import RadixKey

    return RadixKey(prompt)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_loading_frees_everything(overlap):
    run = FakeRun(
        total_tokens=DEVICE_TOKENS,
        max_running=4,
        overlap=overlap,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
    )
    prompt = [random.Random(1).randrange(3, 97) for _ in range(300)]
    _fill_then_evict(run, prompt)
    gate = _hold_copies(run)
    run.submit("again", prompt + [5, 6, 7], max_new=4)
    other = [random.Random(2).randrange(3, 97) for _ in range(50)]
    run.submit("other", other, max_new=6)
    for _ in range(30):  # the loading request waits; the other one runs to the end
        run.step()
    assert "other" in run.reasons() and "again" not in run.reasons()
    assert run.s.hicache.has_pending()
    run.abort("again")
    gate.set()
    run.drain()
    assert run.reasons()["again"]["type"] == "abort"
    assert run.tokens()["other"] == expected_output(other, 6)
    run.s.hicache.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_loading_request_gets_the_loaded_prefix(overlap):
    run = FakeRun(
        total_tokens=DEVICE_TOKENS,
        max_running=4,
        overlap=overlap,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_through",
        hicache_ratio=4.0,  # write-through keeps a backup of the fillers too
    )
    prompt = [random.Random(1).randrange(3, 97) for _ in range(300)]
    _fill_then_evict(run, prompt)
    run.submit("again", prompt + [5, 6, 7], max_new=4)
    run.drain()
    assert run.tokens()["again"] == expected_output(prompt + [5, 6, 7], 4)
    cached = {r: n for m in run.outs for r, n in zip(m.rids, m.cached_tokens, strict=True)}
    assert cached["again"] >= 300
    assert run.s.get_server_info()["hicache_host_hit_tokens"] >= 300


def test_retraction_with_hierarchical_cache():
    """Decode outgrows a small pool: requests are retracted, re-admitted (their prefixes
    loaded back from the host) and still produce exact outputs."""
    run = FakeRun(
        total_tokens=256,
        max_running=8,
        overlap=False,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
    )
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(3, 97) for _ in range(40)] for i in range(6)}
    for rid, p in prompts.items():
        run.submit(rid, p, max_new=30)
    run.drain()
    assert run.s.stats.num_retractions > 0
    got = run.tokens()
    for rid, p in prompts.items():
        assert got[rid] == expected_output(p, 30)


def test_page_size_4_and_lpm():
    run, cached = _run(
        False,
        enable_hierarchical_cache=True,
        page_size=4,
        schedule_policy="lpm",
    )
    assert sum(cached.values()) > 0
    assert run.s.get_server_info()["hicache_host_hit_tokens"] > 0


def test_storage_survives_a_restart(tmp_path):
    """Scheduler 1 serves prompts and closes; scheduler 2 over the same storage directory
    (fresh device and host tiers) reads the prefix back from disk."""
    flags = file_storage_flags(tmp_path)
    prompt = [random.Random(5).randrange(3, 97) for _ in range(200)]
    first = FakeRun(total_tokens=DEVICE_TOKENS, max_running=4, overlap=True, **flags)
    first.submit("a", prompt, max_new=8)
    first.drain()
    assert first.s.get_server_info()["hicache_storage_write_tokens"] >= 192
    first.s.close()
    second = FakeRun(total_tokens=DEVICE_TOKENS, max_running=4, overlap=True, **flags)
    second.submit("b", prompt, max_new=8)
    second.drain()
    assert second.tokens()["b"] == expected_output(prompt, 8)
    cached = {r: n for m in second.outs for r, n in zip(m.rids, m.cached_tokens, strict=True)}
    assert cached["b"] == 192  # six whole 32-token blocks (the last token is always computed)
    assert second.s.get_server_info()["hicache_storage_hit_tokens"] == 192


def test_storage_keys_keep_each_extra_key_apart():
    """A request with extra_key "None" read the blocks of requests with no extra key (the chain
    seed was formatted: both read "None")."""
    from radixserve.mem_cache.hicache_storage import block_hashes

    tokens = list(range(3, 67))
    chains = [block_hashes(tokens, 32, key) for key in (None, "None", "", "x")]
    assert all(len(c) == 2 for c in chains)
    assert len({c[0] for c in chains}) == len(chains)


class _FullDiskFile:
    """A file on a full disk: opening works, every write fails with ENOSPC."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_stores_nothing_and_leaves_no_files(tmp_path, monkeypatch):
    """While the storage directory's disk is full the writes fail: no temporary file is left
    behind, nothing is counted as written, outputs stay exact; once there is room again the
    same blocks are written."""
    from radixserve.mem_cache import hicache_storage

    full_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if k[0] != "_"})
    full_os.fdopen = lambda fd, mode: _FullDiskFile(fd)
    monkeypatch.setattr(hicache_storage, "os", full_os)
    flags = file_storage_flags(tmp_path)
    prompt = [random.Random(6).randrange(3, 97) for _ in range(200)]
    run = FakeRun(total_tokens=DEVICE_TOKENS, max_running=4, overlap=True, **flags)
    run.submit("a", prompt, max_new=8)
    run.drain()
    info = run.s.get_server_info()
    assert info["hicache_storage_write_tokens"] == 0
    assert info["hicache_storage_blocks"] == 0
    (namespace,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / namespace) == []
    monkeypatch.undo()  # room again
    run.submit("b", prompt + [5], max_new=8)
    run.drain()
    assert run.tokens()["a"] == expected_output(prompt, 8)
    assert run.tokens()["b"] == expected_output(prompt + [5], 8)
    assert run.s.get_server_info()["hicache_storage_write_tokens"] == 192
    assert len(os.listdir(tmp_path / namespace)) == 6
    run.s.close()


def test_tier_hits_reach_the_metrics():
    from radixserve.managers.metrics import ServerMetrics

    run, _ = _run(False, enable_hierarchical_cache=True, hicache_write_policy="write_back")
    info = run.s.get_server_info()
    metrics = ServerMetrics("m")
    metrics.update_from_server_info(info)
    text = metrics.render().decode()
    line = next(
        x for x in text.splitlines() if x.startswith("sglang:hicache_host_hit_tokens_total")
    )
    assert float(line.rsplit(" ", 1)[1]) == info["hicache_host_hit_tokens"] > 0


def _written_to_storage(tmp_path, prompt: list[int]) -> None:
    """Serve prompt once and close: its whole blocks are in the storage directory."""
    first = FakeRun(total_tokens=512, max_running=8, **file_storage_flags(tmp_path))
    first.submit("w", prompt, max_new=1)
    first.drain()
    assert first.s.get_server_info()["hicache_storage_write_tokens"] == len(prompt) // 32 * 32
    first.s.close()


def _gate_storage(run: FakeRun):
    """Make the storage thread wait until the returned event is set (a slow disk)."""
    import threading

    gate = threading.Event()
    store = run.s.hicache.controller._store
    run.s.hicache.controller.storer.run = lambda op: (gate.wait(30), store(op))[1]
    return gate


def test_a_decode_short_of_room_does_not_wait_for_a_storage_read_from_the_root(tmp_path):
    """A decode step short of room waited (up to 30 s) for every cache copy in flight before
    retracting, a slow storage read included, though a read of a prefix that starts at the root
    locks host slots only: every decoding request froze until the disk was done. It retracts at
    once now; a read below a device path (its lock holds device tokens) is still waited for."""
    import threading

    rng = random.Random(0)
    prefix = [rng.randrange(3, 97) for _ in range(128)]
    _written_to_storage(tmp_path, prefix + [5])
    run = FakeRun(total_tokens=256, max_running=8, overlap=False, **file_storage_flags(tmp_path))
    hc = run.s.hicache
    gate = _gate_storage(run)
    run.submit("s", prefix + [7, 8], max_new=2)
    run.step()
    (read,) = hc.ops
    assert read.kind == "storage_read" and read.node is hc.root_node
    assert not hc.holds_device_slots()
    prompts = {f"d{i}": [rng.randrange(3, 97) for _ in range(40)] for i in range(4)}
    for rid, p in prompts.items():
        run.submit(rid, p, max_new=60)  # 4 × 100 tokens > the 256-token pool: a retraction
    timer = threading.Timer(5.0, gate.set)  # (the bug waited for the read: then it was done)
    timer.start()
    for _ in range(2000):
        run.step()
        if run.s.stats.num_retractions:
            break
    assert run.s.stats.num_retractions and not read.done.is_set()
    timer.cancel()
    gate.set()
    run.drain()
    for rid, p in {**prompts, "s": prefix + [7, 8]}.items():
        assert run.tokens()[rid] == expected_output(p, run.max_new[rid]), rid
    run.s.close()

    run = FakeRun(total_tokens=256, max_running=8, overlap=False, **file_storage_flags(tmp_path))
    run.submit("head", prefix[:32] + [9], max_new=1)  # the first block: on the device
    run.drain()
    gate = _gate_storage(run)
    run.submit("s", prefix + [7, 8], max_new=2)
    run.step()
    (read,) = run.s.hicache.ops
    assert read.kind == "storage_read" and read.node is not run.s.hicache.root_node
    assert run.s.hicache.holds_device_slots()
    gate.set()
    run.drain()
    assert run.tokens()["s"] == expected_output(prefix + [7, 8], 2)
    run.s.close()


def _cached(run: FakeRun) -> dict[str, int]:
    return {
        rid: n for m in run.token_outputs() for rid, n in zip(m.rids, m.cached_tokens, strict=True)
    }


def test_requests_sharing_a_stored_prefix_read_it_once(tmp_path):
    """Each request whose match stopped at the device read the stored prefix again, into host
    slots of its own: the duplicates filled the host tier, and the requests that came after
    found no room and recomputed the prefix. One read per block now; the others wait for it."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 97) for _ in range(256)]
    _written_to_storage(tmp_path, prefix + [5])
    flags = file_storage_flags(tmp_path) | {"hicache_ratio": 2.0}
    run = FakeRun(total_tokens=512, max_running=16, overlap=False, **flags)
    hc = run.s.hicache
    gate = _gate_storage(run)
    reads = []
    storage_read = hc.controller.storage_read
    hc.controller.storage_read = lambda op: (reads.append(op), storage_read(op))[1]
    prompts = {f"r{i}": prefix + [rng.randrange(3, 97) for _ in range(8)] for i in range(6)}
    for rid, p in prompts.items():  # they arrive while the disk is still reading
        run.submit(rid, p, max_new=2)
        run.step()
    gate.set()
    run.drain()
    assert len(reads) == 1 and len(reads[0].keys) == 8
    assert _cached(run) == dict.fromkeys(prompts, 256)
    assert run.s.get_server_info()["hicache_storage_hit_tokens"] == 256
    for rid, p in prompts.items():
        assert run.tokens()[rid] == expected_output(p, 2), rid
    run.s.close()


def test_a_request_short_of_room_looks_at_storage_again(tmp_path):
    """A request that could not read its stored blocks in one round (no room for them) never
    looked at storage again, and recomputed them once there was room."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, 97) for _ in range(128)]
    _written_to_storage(tmp_path, prefix + [5])
    run = FakeRun(total_tokens=256, max_running=8, overlap=False, **file_storage_flags(tmp_path))
    run.submit("head", prefix[:32] + [9], max_new=1)  # the first block: on the device
    run.drain()
    run.submit("s", prefix + [7, 8], max_new=2)
    (req,) = run.s.waiting_queue
    hc = run.s.hicache
    assert hc.prepare(req, budget=0)  # locking the first block is past the round's room
    assert not hc.ops
    run.drain()
    assert run.tokens()["s"] == expected_output(prefix + [7, 8], 2)
    assert _cached(run)["s"] == 128
    run.s.close()
