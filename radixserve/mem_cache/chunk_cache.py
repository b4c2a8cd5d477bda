"""ChunkCache: the prefix cache used with --disable-radix-cache; it shares and keeps nothing.

It has RadixCache's public interface so the Scheduler drives both the same way. Every request
owns all of its slots: prefixes never match, a chunked-prefill request just keeps its computed
slots between chunks, and a finished request frees everything it allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.radix_cache import MatchResult, RadixKey, TreeNode


class ChunkCache:
    """A prefix cache that holds no tokens."""

    disabled = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        eviction_policy: str = "lru",
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = req_to_token_pool.device
        self.root_node = TreeNode(RadixKey([]), self._empty(), None, 0.0)

    def reset(self) -> None:
        pass

    def match_prefix(self, key: RadixKey) -> MatchResult:
        return MatchResult(device_indices=self._empty(), last_node=self.root_node)

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int | None = None,
        bump_hit: bool = True,
    ) -> int:
        """Keeps nothing. Returns len(key) so that a caller following RadixCache's contract
        (free your slots for the returned prefix) frees every slot it passed in."""
        return len(key)

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Free every slot the request allocated and its req_to_token row."""
        kv_indices = self._req_slots(req, req.kv_allocated_len)
        if kv_indices.numel():
            self.token_to_kv_pool_allocator.free(kv_indices)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any) -> None:
        """Keep the computed slots as the request's private prefix for its next chunk."""
        req.prefix_indices = self._req_slots(req, len(req.fill_ids))

    def pretty_print(self) -> str:
        return "ChunkCache (prefix caching disabled)"

    def check_integrity(self) -> None:
        assert not self.root_node.children, "ChunkCache must never hold nodes"

    def _req_slots(self, req: Any, length: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :length].to(torch.int64)

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)
