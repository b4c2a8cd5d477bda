"""A scheduler stand-in for the prefix-cache tests: fake requests that match, chunk-prefill,
decode and finish against real memory pools, driving the cache the way the Scheduler does."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import RadixKey, TreeNode


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    extra_key: str | None = None
    priority: int | None = None
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    cache_protected_len: int = 0

    def private_slots(self) -> int:
        """Slots this request owns outright (not yet handed to the tree)."""
        return self.kv_allocated_len - self.cache_protected_len


class Sim:
    """Pools + a cache + live requests; every method mirrors one scheduler action."""

    def __init__(self, cache_cls: type, size: int = 64, page_size: int = 1, rows: int = 8) -> None:
        self.req_pool = ReqToTokenPool(rows, max_context_len=128)
        self.allocator = TokenToKVPoolAllocator(size, page_size=page_size)
        self.cache = cache_cls(self.req_pool, self.allocator, page_size=page_size)
        self.page_size = page_size
        self.live: list[FakeReq] = []

    def admit(self, ids: list[int], extra_key: str | None = None) -> FakeReq | None:
        rows = self.req_pool.alloc(1)
        if rows is None:
            return None
        req = FakeReq(list(ids), extra_key=extra_key, req_pool_idx=rows[0])
        # Like the scheduler, keep at least one prompt token to compute.
        m = self.cache.match_prefix(RadixKey(req.origin_input_ids[:-1], extra_key))
        self.cache.inc_lock_ref(m.last_node)
        n = len(m.device_indices)
        self.req_pool.write(req.req_pool_idx, 0, m.device_indices)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        req.kv_committed_len = req.kv_allocated_len = req.cache_protected_len = n
        req.fill_ids = req.origin_input_ids[:n]
        self.live.append(req)
        return req

    def _alloc_upto(self, req: FakeReq, length: int) -> bool:
        ps = self.page_size
        want = -(-length // ps) * ps
        need = want - req.kv_allocated_len
        if need <= 0:
            return True
        if self.allocator.available_size() < need:
            self.cache.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc(need)
        if slots is None:
            return False
        self.req_pool.write(req.req_pool_idx, req.kv_allocated_len, slots)
        req.kv_allocated_len = want
        return True

    def prefill_chunk(self, req: FakeReq, chunk: int) -> bool:
        """Compute up to `chunk` more prompt tokens; cache the partial prefill if unfinished."""
        end = min(req.kv_committed_len + chunk, len(req.origin_input_ids))
        if not self._alloc_upto(req, end):
            return False
        req.kv_committed_len = end
        req.fill_ids = req.origin_input_ids[:end]
        if end < len(req.origin_input_ids):
            self.cache.cache_unfinished_req(req)
        elif not req.output_ids:
            req.output_ids.append(7)  # the first sampled token has no KV yet
        return True

    def decode(self, req: FakeReq, token: int = 5) -> bool:
        if not req.output_ids or not self._alloc_upto(req, req.kv_committed_len + 1):
            return False
        req.kv_committed_len += 1
        req.output_ids.append(token)
        return True

    def run_to_end(self, req: FakeReq, chunk: int = 4, decode_steps: int = 3) -> None:
        while not req.output_ids:
            assert self.prefill_chunk(req, chunk)
        for _ in range(decode_steps):
            assert self.decode(req)

    def finish(self, req: FakeReq, is_insert: bool = True) -> None:
        self.cache.cache_finished_req(req, is_insert=is_insert)
        self.live.remove(req)

    def check(self) -> None:
        """Integrity of cache and pools, plus slot conservation: every page is exactly one of
        free, owned by the tree, or private to one live request."""
        self.cache.check_integrity()
        self.allocator.check_integrity()
        self.req_pool.check_integrity()
        held = sum(r.private_slots() for r in self.live)
        total = (
            self.allocator.available_size()
            + self.cache.evictable_size()
            + self.cache.protected_size()
            + held
        )
        assert total == self.allocator.size, "KV slots leaked or double-counted"
        tree = _tree_slots(self.cache.root_node)
        rows = self.req_pool.req_to_token.to(torch.int64)
        owned = [tree]
        for r in self.live:
            protected = rows[r.req_pool_idx, : r.cache_protected_len]
            assert torch.isin(protected, tree).all(), "a request's cached prefix is not the tree's"
            owned.append(rows[r.req_pool_idx, r.cache_protected_len : r.kv_allocated_len])
        owned_slots = torch.cat(owned)
        # Owned ranges are whole pages; count each page once, by its first slot.
        owned_pages = owned_slots[owned_slots % self.page_size == 0] // self.page_size
        assert len(owned_pages) * self.page_size == len(owned_slots), "a partial page is owned"
        pages = torch.cat([owned_pages, self.allocator.free_pages])
        assert len(torch.unique(pages)) == len(pages), "a page is owned twice (or owned and free)"


def _tree_slots(root: TreeNode) -> torch.Tensor:
    values, stack = [torch.empty(0, dtype=torch.int64)], [root]
    while stack:
        node = stack.pop()
        values.append(node.value.to(torch.int64))
        stack.extend(node.children.values())
    return torch.cat(values)


@pytest.fixture
def make_sim():
    return Sim
