"""ChunkCache: nothing is shared or kept; every request frees all of its slots."""

from __future__ import annotations

import torch

from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.radix_cache import RadixKey


def test_chunk_cache_keeps_nothing_and_frees_everything(make_sim) -> None:
    sim = make_sim(ChunkCache, size=64, page_size=4)
    cache = sim.cache
    assert cache.disabled
    first = sim.admit(list(range(1, 11)))
    sim.run_to_end(first)
    sim.finish(first)
    assert sim.allocator.available_size() == 64

    req = sim.admit(list(range(1, 11)))
    assert req.cache_protected_len == 0 and req.last_node is cache.root_node
    assert sim.prefill_chunk(req, 6)
    row = sim.req_pool.req_to_token[req.req_pool_idx, :6].to(torch.int64)
    assert req.prefix_indices.equal(row)  # chunk slots stay with the request
    sim.check()
    sim.run_to_end(req)
    sim.finish(req)
    sim.check()
    assert sim.allocator.available_size() == 64
    assert req.req_pool_idx is None
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    assert cache.evict(100) == 0


def test_chunk_cache_match_is_always_empty() -> None:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

    cache = ChunkCache(ReqToTokenPool(2, 16), TokenToKVPoolAllocator(16))
    assert cache.insert(RadixKey([1, 2, 3]), torch.arange(3)) == 3
    m = cache.match_prefix(RadixKey([1, 2, 3]))
    assert m.device_indices.numel() == 0 and m.device_indices.dtype == torch.int64
    assert m.last_node is cache.root_node
    assert cache.inc_lock_ref(m.last_node) == 0 == cache.dec_lock_ref(m.last_node)
    cache.reset()
    cache.check_integrity()
    assert "disabled" in cache.pretty_print()
