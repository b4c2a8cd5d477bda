"""RadixCache: matching, splitting, dedup, locking, eviction policies, paging, extra_key
namespaces, request bookkeeping and a randomized slot-conservation property."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.mem_cache.evict_policy import EVICTION_POLICIES, get_evict_key_fn
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixCache, RadixKey, match_length


def make_cache(size: int = 256, page_size: int = 1, policy: str = "lru") -> RadixCache:
    counter = itertools.count(1)
    return RadixCache(
        ReqToTokenPool(4, 64),
        TokenToKVPoolAllocator(size, page_size=page_size),
        page_size=page_size,
        eviction_policy=policy,
        clock=lambda: float(next(counter)),
    )


def insert_fresh(cache: RadixCache, ids: list[int], extra_key: str | None = None) -> int:
    """Insert ids with newly allocated slots, freeing the duplicates as a caller must."""
    slots = cache.token_to_kv_pool_allocator.alloc(len(ids))
    assert slots is not None
    n = cache.insert(RadixKey(ids, extra_key), slots)
    cache.token_to_kv_pool_allocator.free(slots[:n])
    return n


def edges(cache: RadixCache) -> list[list[int]]:
    return sorted(c.key.token_ids for c in cache.root_node.children.values())


def test_match_length_galloping_agrees_with_linear_scan() -> None:
    a = list(range(100))
    for cut in [0, 1, 2, 3, 17, 64, 99]:
        b = a[:cut] + [-1] + a[cut + 1 :]
        assert match_length(a, b, 1) == cut
        assert match_length(a, b, 4) == cut // 4 * 4
    assert match_length(a, a[:50], 1) == 50
    assert match_length(a, a, 8) == 96


def test_match_ending_mid_edge_splits_and_returns_exact_prefix() -> None:
    cache = make_cache()
    slots = torch.arange(10, 16)
    assert cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), slots) == 0
    m = cache.match_prefix(RadixKey([1, 2, 3, 9]))
    assert m.device_indices.tolist() == [10, 11, 12]
    assert m.device_indices.dtype == torch.int64
    assert m.last_node.key.token_ids == [1, 2, 3]
    (child,) = m.last_node.children.values()
    assert child.key.token_ids == [4, 5, 6] and child.value.tolist() == [13, 14, 15]
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7])).device_indices.tolist() == [
        *range(10, 16)
    ]
    assert cache.total_size() == 6
    cache.check_integrity()


def test_empty_match_returns_root_and_empty_tensor() -> None:
    cache = make_cache()
    cache.insert(RadixKey([1, 2]), torch.tensor([3, 4]))
    for key in ([], [9, 9], [2, 1]):
        m = cache.match_prefix(RadixKey(key))
        assert m.last_node is cache.root_node and m.device_indices.numel() == 0
        assert m.device_indices.dtype == torch.int64


def test_insert_returns_already_present_length_and_keeps_original_slots() -> None:
    cache = make_cache()
    assert cache.insert(RadixKey([1, 2, 3]), torch.tensor([11, 12, 13])) == 0
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), torch.tensor([21, 22, 23, 24, 25])) == 3
    assert cache.insert(RadixKey([1, 2, 7]), torch.tensor([31, 32, 33])) == 2
    assert cache.insert(RadixKey([1, 2, 3, 4, 5]), torch.tensor([41, 42, 43, 44, 45])) == 5
    # Dedup: the first inserter's slots stay canonical; the tree holds 6 distinct tokens.
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5])).device_indices.tolist() == [
        11,
        12,
        13,
        24,
        25,
    ]
    assert cache.match_prefix(RadixKey([1, 2, 7])).device_indices.tolist() == [11, 12, 33]
    assert cache.total_size() == cache.evictable_size() == 6
    cache.check_integrity()


def test_hit_count_bumped_only_when_asked() -> None:
    cache = make_cache()
    cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4), bump_hit=False)
    cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4, 8), bump_hit=False)
    node = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    assert node.hit_count == 0
    cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), torch.arange(8, 14))
    assert node.hit_count == 1
    assert cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6])).last_node.hit_count == 1


def test_lock_ref_moves_sizes_between_evictable_and_protected() -> None:
    cache = make_cache()
    cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4))
    cache.insert(RadixKey([1, 2, 5, 6, 7]), torch.arange(4, 9))
    a = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    b = cache.match_prefix(RadixKey([1, 2, 5, 6, 7])).last_node
    assert (cache.evictable_size(), cache.protected_size()) == (7, 0)
    assert cache.inc_lock_ref(a) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (3, 4)
    assert cache.inc_lock_ref(b) == 3  # the shared [1, 2] is already protected
    assert cache.inc_lock_ref(a) == 0
    assert (cache.evictable_size(), cache.protected_size()) == (0, 7)
    cache.check_integrity()
    assert cache.dec_lock_ref(a) == 0
    assert cache.dec_lock_ref(a) == 2
    assert cache.dec_lock_ref(b) == 5
    assert (cache.evictable_size(), cache.protected_size()) == (7, 0)
    assert cache.inc_lock_ref(cache.root_node) == 0 and cache.root_node.lock_ref == 0
    cache.check_integrity()


def test_split_of_a_locked_node_keeps_accounting() -> None:
    cache = make_cache()
    cache.insert(RadixKey([1, 2, 3, 4]), torch.arange(4))
    node = cache.match_prefix(RadixKey([1, 2, 3, 4])).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix(RadixKey([1, 2, 9]))  # splits the locked edge
    cache.check_integrity()
    assert cache.protected_size() == 4
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    cache.check_integrity()


def test_evict_never_touches_locked_nodes_and_frees_slots() -> None:
    cache = make_cache(size=32)
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])
    insert_fresh(cache, [8, 9])
    locked = cache.match_prefix(RadixKey([1, 2, 3, 4]))
    cache.inc_lock_ref(locked.last_node)
    before = cache.token_to_kv_pool_allocator.available_size()
    assert cache.evict(100) == 4  # [5, 6] and [8, 9]; [1, 2] still has a locked child
    assert cache.token_to_kv_pool_allocator.available_size() == before + 4
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.equal(locked.device_indices)
    assert cache.evictable_size() == 0 and cache.protected_size() == 4
    cache.check_integrity()
    cache.dec_lock_ref(locked.last_node)
    assert cache.evict(100) == 4
    assert cache.token_to_kv_pool_allocator.available_size() == 32
    assert cache.total_size() == 0 and not cache.root_node.children


def test_evict_cascades_to_parent_and_stops_once_enough() -> None:
    cache = make_cache(size=32)
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6, 7])
    assert cache.evict(1) == 2  # the least recently used leaf only
    assert edges(cache) == [[1, 2]]
    assert cache.evict(4) == 5  # the other leaf, then the parent that became a leaf
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 32
    assert cache.evict(1) == 0


# Leaves A..D with controlled stats: (creation, last access, hits, priority).
STATS = {
    1: (1.0, 6.0, 1, 5),
    2: (2.0, 4.0, 3, 0),
    3: (3.0, 5.0, 2, 0),
    4: (4.0, 7.0, 1, 1),
}
EXPECTED_ORDER = {
    "lru": [2, 3, 1, 4],
    "mru": [4, 1, 3, 2],
    "fifo": [1, 2, 3, 4],
    "filo": [4, 3, 2, 1],
    "lfu": [1, 4, 3, 2],
    "priority": [2, 3, 4, 1],
    "slru": [1, 4, 2, 3],
}


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_eviction_policy_order(policy: str) -> None:
    cache = make_cache(size=32, policy=policy)
    for first, (created, accessed, hits, prio) in STATS.items():
        insert_fresh(cache, [first, 0])
        node = cache.root_node.children[(None, (first,))]
        node.creation_time, node.last_access_time = created, accessed
        node.hit_count, node.priority = hits, prio
    order = []
    for _ in STATS:
        remaining = {e[0] for e in edges(cache)}
        assert cache.evict(1) == 2
        (gone,) = remaining - {e[0] for e in edges(cache)}
        order.append(gone)
    assert order == EXPECTED_ORDER[policy]


def test_lru_follows_real_accesses_and_unknown_policy_is_rejected() -> None:
    cache = make_cache(size=32)
    insert_fresh(cache, [1, 1])
    insert_fresh(cache, [2, 2])
    cache.match_prefix(RadixKey([1, 1]))
    cache.evict(1)
    assert edges(cache) == [[1, 1]]
    with pytest.raises(ValueError, match="unknown eviction policy"):
        get_evict_key_fn("random")


@pytest.mark.parametrize("ps", [4, 16])
def test_page_size_rounds_matches_down_to_whole_pages(ps: int) -> None:
    cache = make_cache(size=8 * ps, page_size=ps)
    ids = list(range(100, 100 + 2 * ps))
    slots = cache.token_to_kv_pool_allocator.alloc(2 * ps)
    assert cache.insert(RadixKey(ids), slots) == 0
    assert cache.match_prefix(RadixKey(ids[: 2 * ps - 1])).device_indices.equal(slots[:ps])
    diverge = ids[: ps + 1] + [-1] * (ps - 1)  # differs inside the second page
    m = cache.match_prefix(RadixKey(diverge))
    assert m.device_indices.equal(slots[:ps]) and len(m.last_node.key) == ps
    assert cache.match_prefix(RadixKey(ids[: ps - 1])).device_indices.numel() == 0
    assert insert_fresh(cache, ids[:ps] + [-1] * ps) == ps
    assert sorted(len(c.key) for c in m.last_node.children.values()) == [ps, ps]
    cache.check_integrity()
    assert cache.evict(10**6) == 3 * ps
    assert cache.token_to_kv_pool_allocator.available_size() == 8 * ps
    with pytest.raises(AssertionError):
        cache.insert(RadixKey(ids[:ps] + [0]), torch.arange(ps + 1))


def test_extra_key_namespaces_never_share_nodes() -> None:
    cache = make_cache()
    ids = [1, 2, 3, 4]
    assert cache.insert(RadixKey(ids, "lora-a"), torch.arange(4)) == 0
    assert cache.match_prefix(RadixKey(ids)).device_indices.numel() == 0
    assert cache.match_prefix(RadixKey(ids, "lora-b")).device_indices.numel() == 0
    assert cache.match_prefix(RadixKey(ids, "lora-a")).device_indices.tolist() == [0, 1, 2, 3]
    assert cache.insert(RadixKey(ids, "lora-b"), torch.arange(4, 8)) == 0
    assert cache.insert(RadixKey(ids), torch.arange(8, 12)) == 0
    assert cache.total_size() == 12 and len(cache.root_node.children) == 3
    assert cache.match_prefix(RadixKey(ids[:2], "lora-b")).device_indices.tolist() == [4, 5]
    cache.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
def test_requests_sharing_a_prefix_leave_no_slot_behind(make_sim, ps: int) -> None:
    sim = make_sim(RadixCache, size=128, page_size=ps)
    prompt = list(range(1, 19))
    a = sim.admit(prompt)
    b = sim.admit(prompt)  # admitted before A cached anything: no prefix, duplicate KV
    for _ in range(2):
        sim.prefill_chunk(a, 5)
        sim.prefill_chunk(b, 5)
        sim.check()
    aligned = 10 // ps * ps
    rows = sim.req_pool.req_to_token
    assert rows[b.req_pool_idx, :aligned].equal(rows[a.req_pool_idx, :aligned])
    assert b.last_node is a.last_node and b.cache_protected_len == aligned
    assert b.prefix_indices.numel() == 10
    sim.run_to_end(a)
    sim.run_to_end(b)
    sim.finish(a)
    sim.check()
    c = sim.admit(prompt + [99])
    assert c.cache_protected_len == len(prompt) // ps * ps  # A's prompt is cached
    sim.finish(b)
    sim.run_to_end(c, decode_steps=1)
    sim.finish(c)
    sim.check()
    assert sim.cache.protected_size() == 0
    assert sim.allocator.available_size() + sim.cache.evictable_size() == 128
    sim.cache.evict(10**6)
    assert sim.allocator.available_size() == 128
    assert sim.req_pool.available_size() == sim.req_pool.size


def test_retracted_request_frees_only_its_private_slots(make_sim) -> None:
    sim = make_sim(RadixCache, size=64)
    first = sim.admit([1, 2, 3, 4, 5, 6])
    sim.run_to_end(first)
    sim.finish(first)
    req = sim.admit([1, 2, 3, 4, 5, 6, 8, 9])
    assert req.cache_protected_len == 6
    sim.run_to_end(req, decode_steps=2)
    size_before = sim.cache.total_size()
    sim.finish(req, is_insert=False)
    sim.check()
    assert sim.cache.total_size() == size_before and sim.cache.protected_size() == 0
    sim.cache.evict(10**6)
    assert sim.allocator.available_size() == 64


def test_scratch_tree_without_pools_matches_and_evicts() -> None:
    sim = RadixCache(None, None)  # the scheduler's in-batch prefix check uses one like this
    sim.insert(RadixKey([1, 2, 3]), torch.tensor([1, 2, 3]))
    assert len(sim.match_prefix(RadixKey([1, 2, 4])).device_indices) == 2
    assert sim.evict(10) == 3
    sim.check_integrity()


def test_reset_drops_the_tree() -> None:
    cache = make_cache()
    cache.insert(RadixKey([1, 2, 3]), torch.arange(3))
    assert "[3] [1, 2, 3]" in cache.pretty_print()
    cache.reset()
    assert cache.total_size() == 0 and not cache.root_node.children
    cache.check_integrity()


def test_check_integrity_catches_broken_accounting() -> None:
    cache = make_cache()
    cache.insert(RadixKey([1, 2, 3]), torch.arange(3))
    cache.insert(RadixKey([4, 5]), torch.tensor([0, 9]))  # slot 0 reused
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity()
    cache.reset()
    cache.insert(RadixKey([1, 2, 3]), torch.arange(3))
    cache._evictable_size += 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_integrity()


def reference_match(cache: RadixCache, key: RadixKey) -> list[int]:
    """Token-by-token walk of the tree: the slots match_prefix must return."""
    node, pos, slots = cache.root_node, 0, []
    ids, ps = key.token_ids, cache.page_size
    while True:
        for child in node.children.values():
            edge, k = child.key.token_ids, 0
            while k < len(edge) and pos + k < len(ids) and edge[k] == ids[pos + k]:
                k += 1
            # A child is entered only through a whole matching first page: with pages of 2,
            # siblings [4, 0] and [4, 5] share a first token, and [4, 5] must be the one taken.
            if k >= ps and child.key.extra_key == key.extra_key:
                break
        else:
            return slots
        k = k // ps * ps
        slots += child.value[:k].tolist()
        pos += k
        if k < len(edge):
            return slots
        node = child


# Weighted toward steps so that requests get through prefill and decode; binary tokens so that
# prompts share prefixes and concurrent requests compute duplicate KV.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit"] * 2 + ["step"] * 5 + ["finish", "abort", "evict", "match"]),
        st.integers(0, 63),
        st.lists(st.integers(0, 1), min_size=2, max_size=14),
    ),
    min_size=10,
    max_size=60,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, ps=st.sampled_from([1, 2]), extra=st.sampled_from([None, "x"]))
def test_random_workload_keeps_tree_and_slots_consistent(make_sim, ops, ps, extra) -> None:
    sim = make_sim(RadixCache, size=48, page_size=ps, rows=4)
    for op, n, ids in ops:
        req = sim.live[n % len(sim.live)] if sim.live else None
        extra_key = extra if n % 2 else None
        if op == "admit":
            sim.admit(ids, extra_key=extra_key)
        elif op == "step" and req is not None:
            if req.output_ids:
                sim.decode(req, token=n % 2)
            else:
                sim.prefill_chunk(req, 1 + n % 5)
        elif op in ("finish", "abort") and req is not None:
            sim.finish(req, is_insert=op == "finish")
        elif op == "evict":
            sim.cache.evict(n)
        elif op == "match":
            key = RadixKey(ids, extra_key)
            expected = reference_match(sim.cache, key)
            assert sim.cache.match_prefix(key).device_indices.tolist() == expected
        sim.check()
    for req in list(sim.live):
        sim.finish(req)
    sim.check()
    assert sim.cache.protected_size() == 0
    sim.cache.evict(10**6)
    assert sim.allocator.available_size() == 48
