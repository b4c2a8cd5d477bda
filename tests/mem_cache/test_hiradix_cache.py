"""HiRadixCache's start-up checks and its accounting under a random workload (random shared
prefixes, arrivals, aborts, both scheduler loops, a tiny device pool and host tier), with the
scheduler's integrity checks after every step and exact outputs at the end."""

from __future__ import annotations

import os
import random
import re
import time

import pytest
import torch
from rs_fake_worker import FakeRun, expected_output

from radixserve.args import ServerArgs
from radixserve.mem_cache.hicache_storage import HiCacheFile, block_hashes
from radixserve.mem_cache.memory_pool_host import HostKVPool, host_pool_tokens

STORAGE = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
        (
            {"enable_hierarchical_cache": True, "disable_radix_cache": True},
            "drop --disable-radix-cache",
        ),
        (
            {**STORAGE, "page_size": 16, "hicache_storage_block_size": 40},
            "multiple of --page-size 16",
        ),
        # Storage options without a storage tier were ignored (no KV was ever written there).
        ({"hicache_storage_dir": "/data/kv"}, "--hicache-storage-dir configure the storage"),
        (
            {"enable_hierarchical_cache": True, "hicache_storage_block_size": 32},
            "add --hicache-storage-backend file",
        ),
        ({"enable_hierarchical_cache": True, "hicache_ratio": 0}, "--hicache-ratio must be > 0"),
        ({"enable_hierarchical_cache": True, "tp_size": 2}, "--tp-size > 1"),
    ],
)
def test_invalid_combinations_are_rejected(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**flags)


def test_a_storage_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    """Found by the scheduler after the model loaded, such a directory was a raw OSError and a
    traceback, and "" wrote the blocks into the server's working directory."""
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    refused = {
        "": "--hicache-storage-dir is empty",
        str(a_file): "is not a directory",
        str(a_file / "kv"): f"cannot write in '{a_file}'",
    }
    if os.path.isdir("/proc"):  # (os.access says yes to root there)
        refused["/proc/kv"] = "cannot write in '/proc'"
    for directory, message in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ServerArgs(**STORAGE, hicache_storage_dir=directory)
    new = tmp_path / "new" / "kv"
    assert ServerArgs(**STORAGE, hicache_storage_dir=str(new))  # made by the tier, later
    assert ServerArgs(**STORAGE, hicache_storage_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the check leaves nothing behind


@pytest.mark.parametrize("page, block", [(16, 64), (48, 96), (128, 128)])
def test_any_page_size_serves_the_hierarchical_cache(page, block):
    """--page-size 128 was refused for the storage block size's default (64), a flag the
    user had not given and that only matters with a storage tier; the default is whole pages."""
    assert ServerArgs(enable_hierarchical_cache=True, page_size=page)
    args = ServerArgs(**STORAGE, page_size=page)
    assert args.hicache_storage_block_size == block


@pytest.mark.parametrize(
    "ratio,size_gb,flag", [(1e30, 0, "--hicache-ratio 1e+30"), (2.0, 1e9, "--hicache-size 1e+09")]
)
def test_a_host_tier_past_the_hosts_memory_is_refused_naming_the_flag(ratio, size_gb, flag):
    """Such a value failed as a raw torch error (an overflow, "can't allocate"), or one just
    past the free RAM was zero-filled until the OOM killer came."""
    with pytest.raises(ValueError, match=re.escape(flag) + " asks for .* GiB available: lower it"):
        host_pool_tokens(1000, 64, ratio=ratio, size_gb=size_gb, page_size=1)


def test_the_host_tiers_of_dp_replicas_are_checked_together(monkeypatch):
    """Each --dp-size replica checked its tier against the whole available memory alone, and
    they start together: two tiers of 60 % each passed, and zero-filled past the RAM."""
    monkeypatch.setattr(
        "radixserve.mem_cache.memory_pool_host.available_host_bytes", lambda: 100 * 2**30
    )
    one = int(60 * 2**30) // 64
    assert host_pool_tokens(1000, 64, ratio=one / 1000, size_gb=0, page_size=1) == one
    with pytest.raises(ValueError, match=r"host tier \(× 2 replicas of --dp-size\)"):
        host_pool_tokens(1000, 64, ratio=one / 1000, size_gb=0, page_size=1, replicas=2)


def test_host_tier_smaller_than_the_device_pool_is_rejected():
    with pytest.raises(ValueError, match="at least the device KV pool"):
        host_pool_tokens(1000, 64, ratio=0.5, size_gb=0, page_size=1)
    assert host_pool_tokens(1000, 64, ratio=2.0, size_gb=0, page_size=16) == 2000
    assert host_pool_tokens(1000, 1024, ratio=2.0, size_gb=0.001, page_size=1) == 1048
    with pytest.raises(ValueError, match="at least the device KV pool"):
        FakeRun(total_tokens=512, enable_hierarchical_cache=True, hicache_ratio=0.5)


@pytest.mark.parametrize("device_tokens, block", [(8192, 4096), (512, 1024)])
def test_a_storage_block_longer_than_any_request_is_refused(tmp_path, device_tokens, block):
    """Past the context length or the device pool, no request fills a block: it was
    accepted and the storage tier was never written."""
    flags = {**STORAGE, "hicache_storage_dir": str(tmp_path), "hicache_storage_block_size": block}
    with pytest.raises(ValueError, match=f"block-size {block} is longer than any request"):
        FakeRun(total_tokens=device_tokens, **flags)
    assert not os.listdir(tmp_path)  # refused before the tier was made


def test_block_hashes_chain_over_the_prefix():
    a = block_hashes(list(range(100)), 32)
    assert len(a) == 3  # the partial last block has no key
    assert block_hashes(list(range(96)), 32) == a
    assert block_hashes(list(range(100)), 32, start_block=1) == a[1:]
    changed = block_hashes([1] + list(range(1, 100)), 32)
    assert all(x != y for x, y in zip(a, changed, strict=True))  # a block's key names its prefix
    assert block_hashes(list(range(100)), 32, extra_key="lora") != a


def test_host_pool_copies_and_bytes_round_trip():
    dev = [torch.arange(40, dtype=torch.float32).view(20, 2), torch.arange(20).view(20, 1)]
    pool = HostKVPool(dev, size=16, page_size=2)
    host = pool.alloc(4)
    src = torch.tensor([4, 5, 10, 11])
    pool.backup_from_device(host, src)
    dst = torch.tensor([16, 17, 18, 19])
    pool.load_to_device(dst, host)
    assert torch.equal(dev[0][dst], dev[0][src]) and torch.equal(dev[1][dst], dev[1][src])
    data = pool.read_device_bytes(src)
    other = pool.alloc(4)
    assert pool.write_host_bytes(other, data)
    assert torch.equal(pool.buffers[0][other], dev[0][src])
    assert not pool.write_host_bytes(other, data[:-1])  # a truncated block is refused


_DAMAGES = {
    "flipped_bits": lambda b: bytes(x ^ 0xFF for x in b[:20]) + b[20:],
    "truncated": lambda b: b[: len(b) // 2],
    "header_only": lambda b: b[:16],
    "empty": lambda b: b"",
    "no_header": lambda b: b[16:],  # a block file of the format before the header
}


@pytest.mark.parametrize("damage", list(_DAMAGES))
def test_a_damaged_block_file_is_a_miss_and_is_deleted(tmp_path, damage):
    store = HiCacheFile(str(tmp_path), "ns")
    data = os.urandom(4096)
    assert store.set("k", data) and store.get("k") == data
    path = tmp_path / "ns" / "k.kv"
    path.write_bytes(_DAMAGES[damage](path.read_bytes()))
    assert HiCacheFile(str(tmp_path), "ns").exists("k")  # listed at start-up: read to know
    assert store.get("k") is None
    assert not store.exists("k") and not path.exists()  # so it is computed and written again
    assert store.set("k", data) and store.get("k") == data


def test_another_blocks_file_under_a_key_is_a_miss_and_is_deleted(tmp_path):
    """A well-formed block copied over another key's file (same size, valid header) was
    served as that key's KV: wrong outputs, on every later server of the directory."""
    store = HiCacheFile(str(tmp_path), "ns")
    mine, other = os.urandom(4096), os.urandom(4096)
    assert store.set("mine", mine) and store.set("other", other)
    path = tmp_path / "ns" / "mine.kv"
    path.write_bytes((tmp_path / "ns" / "other.kv").read_bytes())
    assert store.get("mine") is None
    assert not store.exists("mine") and not path.exists()
    assert store.get("other") == other
    assert store.set("mine", mine) and store.get("mine") == mine


def test_temporary_files_of_a_killed_writer_are_removed_at_start(tmp_path):
    from radixserve.mem_cache.hicache_storage import STALE_TMP_S

    ns = tmp_path / "ns"
    ns.mkdir()
    stale, fresh = ns / "a1b2.tmp", ns / "c3d4.tmp"
    stale.write_bytes(b"half a block")
    fresh.write_bytes(b"another server's write in progress")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    HiCacheFile(str(tmp_path), "ns")
    assert not stale.exists() and fresh.exists()


def _namespace(**flags) -> str:
    from radixserve.mem_cache.hicache_storage import model_identity, storage_namespace

    kv = [torch.zeros(8, 2, 16)] * 4
    return storage_namespace(model_identity(ServerArgs(**flags), flags["model_path"]), kv, 32)


def test_storage_namespace_covers_what_changes_the_kv(tmp_path, monkeypatch):
    """Same KV layout, different KV values: each run gets a namespace of its own."""
    from rs_testing import make_tiny_model_dir

    for name, seed in (("a", 0), ("b", 1)):
        make_tiny_model_dir(str(tmp_path / name / "model"), "llama", seed=seed)
    monkeypatch.chdir(tmp_path / "a")
    base = _namespace(model_path="model")
    assert _namespace(model_path=str(tmp_path / "a" / "model")) == base  # the path made absolute
    assert _namespace(model_path="model", dtype="bfloat16") != base
    assert _namespace(model_path="model", quantization="int4") != base
    assert _namespace(model_path="model", context_length=4096) != base
    dummy = _namespace(model_path="model", load_format="dummy")
    assert dummy != base
    assert _namespace(model_path="model", load_format="dummy", random_seed=1) != dummy
    monkeypatch.chdir(tmp_path / "b")
    assert _namespace(model_path="model") != base  # another model, the same relative path
    monkeypatch.chdir(tmp_path / "a")
    weights = tmp_path / "a" / "model" / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # replaced in place
    assert _namespace(model_path="model") != base


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_random_workload_keeps_every_tier_accounted(seed, overlap, tmp_path):
    rng = random.Random(seed)
    policy = ["write_through", "write_through_selective", "write_back"][seed]
    run = FakeRun(
        total_tokens=256,
        max_running=6,
        overlap=overlap,
        chunked_prefill_size=64,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_ratio=1.5 + seed,
        page_size=[1, 2, 4][seed],
        schedule_policy=["fcfs", "lpm", "dfs-weight"][seed],
        **(
            {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path)}
            | {"hicache_storage_block_size": 16}
            if seed == 1
            else {}
        ),
    )
    roots = [[rng.randrange(3, 97) for _ in range(rng.randrange(20, 120))] for _ in range(5)]
    aborted = set()
    for i in range(40):
        prompt = rng.choice(roots)[: rng.randrange(10, 120)] + [rng.randrange(3, 97)] * 3
        run.submit(f"r{i}", prompt, max_new=rng.randrange(1, 12))
        for _ in range(rng.randrange(0, 6)):
            run.step()
        if rng.random() < 0.15:
            victim = f"r{rng.randrange(0, i + 1)}"
            run.abort(victim)
            aborted.add(victim)
    run.drain()
    got, reasons = run.tokens(), run.reasons()
    for rid, prompt in run.prompts.items():
        if reasons[rid]["type"] != "abort":
            assert got[rid] == expected_output(prompt, run.max_new[rid]), rid
        else:
            assert rid in aborted
    hc = run.s.hicache
    hc.check_integrity()
    hc.check_drained()
    assert hc.host_pool.available_size() + hc.host_evictable_size() == hc.host_pool.size


def test_storage_finds_blocks_another_process_wrote(tmp_path, monkeypatch):
    """The index was the directory at start-up plus this process's own writes: a --dp-size
    replica (or a second server on the directory) never read the blocks another wrote, and
    wrote them again. A miss is looked for on disk again after MISS_RECHECK_S."""
    from radixserve.mem_cache import hicache_storage

    a, b = HiCacheFile(str(tmp_path), "ns"), HiCacheFile(str(tmp_path), "ns")
    assert not b.exists("k1")
    assert a.set("k1", b"kv") and a.set("k2", b"kv")
    assert b.exists("k2")  # never asked before: looked for at once
    assert not b.exists("k1")  # found missing a moment ago: not looked for again yet
    monkeypatch.setattr(hicache_storage, "MISS_RECHECK_S", 0.0)
    assert b.exists("k1") and b.get("k1") == b"kv"
    b.delete("k1")
    assert not b.exists("k1") and not os.path.exists(b._path("k1"))


def test_the_block_count_is_the_directorys(tmp_path, monkeypatch):
    """get_server_info's hicache_storage_blocks was the index's size: with --dp-size 2 each
    replica counted the blocks it listed at start, wrote or looked up, and replica 0's part was
    the server's figure. It is the directory's block files now (listed again now and then)."""
    from radixserve.mem_cache import hicache_storage

    a, b = HiCacheFile(str(tmp_path), "ns"), HiCacheFile(str(tmp_path), "ns")
    for i in range(2):
        assert a.set(f"a{i}", b"kv")
    for i in range(6):
        assert b.set(f"b{i}", b"kv")
    (tmp_path / "ns" / "x.tmp").write_bytes(b"")  # a write in progress is no block
    assert a.num_blocks() == b.num_blocks() == 8
    a.delete("b0")
    assert a.num_blocks() == 8  # (listed a moment ago)
    later = time.monotonic() + 60  # (past the next listing)
    monkeypatch.setattr(hicache_storage.time, "monotonic", lambda: later)
    assert a.num_blocks() == b.num_blocks() == 7
