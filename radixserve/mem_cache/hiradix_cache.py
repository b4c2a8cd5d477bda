"""HiRadixCache: the radix cache over three KV tiers — device, host and storage (HiCache).

A node's KV lives in device slots (`value`), host slots (`host_value`), or both. Evicting a
node from the device demotes it to the host (after a backup if it has none) instead of
dropping it; evicting from the host drops it (its blocks may remain in storage, found again
by their chain hash). A request whose match continues past the device into host nodes (or
storage blocks) waits in a loading state while the cache controller copies them back
(`prepare`); other requests keep running. Write policies decide when a device node gets its
host copy: write_through on insert, write_through_selective once its hit count reaches 2,
write_back only when it is evicted. Finished requests write their whole blocks to storage.

Called by the Scheduler exactly like RadixCache, plus `prepare` (admission), `poll` (every
step: apply finished copies) and `set_compute_fence`. Extra invariants (check_integrity):
* every node has a device or a host copy; a device node's parent is on the device;
* evictable/protected count device tokens only; a loading node is locked and not matched;
* host slots are free, in the tree, or held by a storage read in flight — never two of these;
* a storage block is in one read in flight at most (the requests that share it wait for it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve.mem_cache.cache_controller import STORAGE_READ, CacheOperation, HiCacheController
from radixserve.mem_cache.hicache_integrity import (
    check_tiers,
    check_tiers_drained,
    host_unlocked_tokens,
)
from radixserve.mem_cache.hicache_ops import HiCacheRequestOps
from radixserve.mem_cache.hicache_storage import HiCacheStorage
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.memory_pool_host import (
    HostKVPool,
    buffer_bytes_per_token,
    device_kv_buffers,
    host_pool_tokens,
)
from radixserve.mem_cache.radix_cache import MatchResult, RadixCache, RadixKey, TreeNode
from radixserve.mem_cache.radix_cache import match_length as _match_length

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiTreeNode(TreeNode):
    """A TreeNode whose `value` (device slots) may be None when its KV is only on the host."""

    def __init__(self, key: RadixKey, value: Any, parent: TreeNode | None, now: float) -> None:
        super().__init__(key, value, parent, now)
        self.host_value: torch.Tensor | None = None
        self.loading: CacheOperation | None = None  # host → device copy in flight
        self.backing_up: CacheOperation | None = None  # device → host copy in flight

    @property
    def on_device(self) -> bool:
        """Matchable on the device: slots present and their KV written."""
        return self.value is not None and self.loading is None


class HiRadixCache(HiCacheRequestOps, RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        host_pool: HostKVPool,
        page_size: int = 1,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        write_policy: str = "write_through",
        storage: HiCacheStorage | None = None,
        storage_block_size: int = 64,
    ) -> None:
        assert write_policy in WRITE_POLICIES, write_policy
        assert storage is None or storage_block_size % page_size == 0, "blocks are whole pages"
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.write_through_threshold = 1 if write_policy == "write_through" else 2
        self.controller = HiCacheController(host_pool, storage)
        self.init_request_ops(storage, storage_block_size)
        super().__init__(
            req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy, clock
        )

    def reset(self) -> None:
        """Drop the tree and every host slot (flush_cache, only when nothing runs)."""
        assert not getattr(self, "ops", None), "reset with cache copies in flight"
        self.root_node = HiTreeNode(RadixKey([]), self._empty(), None, self.clock())
        self._evictable_size = 0
        self._protected_size = 0
        self.host_pool.clear()

    def close(self) -> None:
        self.controller.close()

    # ---- matching ----------------------------------------------------------------------------

    def _walk(self, key: RadixKey, device_only: bool) -> list[HiTreeNode]:
        """The nodes of the longest match of key (split at its end); with device_only, stop
        at the first node that is not on the device."""
        key = key[: len(key) // self.page_size * self.page_size]
        now = self.clock()
        node = self.root_node
        node.last_access_time = now
        path: list[HiTreeNode] = []
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None or (device_only and not child.on_device):
                break
            child.last_access_time = now
            n = _match_length(child.key.token_ids, key.token_ids, self.page_size)
            if n < len(child.key):
                child = self._split_node(child, n)
            path.append(child)
            node = child
            key = key[n:]
        return path

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The device part of the match (what a request can use now)."""
        path = self._walk(key, device_only=True)
        if not path:
            return MatchResult(self._empty(), self.root_node)
        return MatchResult(torch.cat([n.value for n in path]), path[-1])

    # ---- insertion -----------------------------------------------------------------------------

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int | None = None,
        bump_hit: bool = True,
    ) -> int:
        """RadixCache.insert, where a host-only node on the path takes the caller's slots
        (it is on the device again) and a loading node is waited for. Returns the device
        prefix that was already present (the caller frees its duplicates there)."""
        assert len(key) == len(value), "key and value must be aligned"
        assert len(key) % self.page_size == 0, "insert expects a page-aligned key"
        now = self.clock()
        node = self.root_node
        prefix_len = 0
        revived = False
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = _match_length(child.key.token_ids, key.token_ids, self.page_size)
            if n < len(child.key):
                child = self._split_node(child, n)
            if child.loading is not None:
                self.wait_for(child.loading)  # rare: another request's load of this prefix
            if child.value is None:
                child.value = value[:n].clone()
                self._add_device_tokens(child, n)
                revived = True
            else:
                assert not revived, "a device node below a host-only node"
                prefix_len += n
            self._touch(child, now, priority, bump_hit)
            self._on_hit(child)
            node = child
            key, value = key[n:], value[n:]
        if len(key):
            leaf = HiTreeNode(key, value.clone(), node, now)
            leaf.hit_count = int(bump_hit)
            leaf.priority = priority if priority is not None else 0
            node.children[self._child_key(key)] = leaf
            self._evictable_size += len(key)
            self._on_hit(leaf)
        return prefix_len

    def insert_host(self, key: RadixKey, start: int, host: torch.Tensor) -> int:
        """Add host slots for key[start:] (fetched from storage) below the existing path;
        frees the slots of tokens the tree already has. Returns the tokens added."""
        now = self.clock()
        node, pos = self.root_node, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            n = _match_length(child.key.token_ids, key.token_ids[pos:], self.page_size)
            if n < len(child.key):
                child = self._split_node(child, n)
            node, pos = child, pos + n
        if pos < start:  # the path shrank (cannot happen while the read holds its lock)
            self.host_pool.free(host)
            return 0
        self.host_pool.free(host[: pos - start])
        if pos == len(key):
            return 0
        leaf = HiTreeNode(key[pos:], None, node, now)
        leaf.host_value = host[pos - start :].clone()
        node.children[self._child_key(leaf.key)] = leaf
        return len(key) - pos

    def _on_hit(self, node: HiTreeNode) -> None:
        """Write-through policies back a node up once it is hit often enough."""
        if self.write_policy == "write_back" or node.host_value is not None:
            return
        if node.value is not None and node.hit_count >= self.write_through_threshold:
            self.backup_async(node)

    # ---- locks (count device tokens only) ------------------------------------------------------

    @staticmethod
    def _device_len(node: TreeNode) -> int:
        """A host-only node's tokens are not in the device pool: locking it moves nothing."""
        return len(node.key) if node.value is not None else 0

    def _add_device_tokens(self, node: HiTreeNode, n: int) -> None:
        if node.lock_ref > 0:
            self._protected_size += n
        else:
            self._evictable_size += n

    # ---- eviction ------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free device slots from unlocked device leaves, policy order; each node keeps (or
        first gets) a host copy, so it is demoted rather than dropped. Without host room it
        is dropped with its host-only subtree."""
        self.poll_backups()  # finished backups release their locks (and become evictable)
        tiebreak = itertools.count()
        heap = [(self.evict_key(n), next(tiebreak), n) for n in self._leaves(self._device_leaf)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            n = len(node.key)
            self._evictable_size -= n
            evicted += n
            if node.host_value is None and not self.backup_now(node):
                self._drop_subtree(node)
            else:
                self._free(node.value)
                node.value = None
                self.stats.device_to_host_tokens += n
            parent = node.parent
            if parent is not self.root_node and self._device_leaf(parent):
                heapq.heappush(heap, (self.evict_key(parent), next(tiebreak), parent))
        return evicted

    def evict_host(self, num_tokens: int) -> int:
        """Free host slots from unlocked host leaves: a node also on the device only loses
        its backup; a host-only node leaves the tree."""
        tiebreak = itertools.count()
        heap = [(self.evict_key(n), next(tiebreak), n) for n in self._leaves(self._host_leaf)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.host_pool.free(node.host_value)
            node.host_value = None
            evicted += len(node.key)
            parent = node.parent
            if node.value is None:
                assert not node.children, "a host-only node with children is not a leaf"
                del parent.children[self._child_key(node.key)]
            if parent is not self.root_node and self._host_leaf(parent):
                heapq.heappush(heap, (self.evict_key(parent), next(tiebreak), parent))
        return evicted

    def alloc_host(self, n: int) -> torch.Tensor | None:
        short = n - self.host_pool.available_size()
        if short > 0:
            self.evict_host(short)
        return self.host_pool.alloc(n)

    def _device_leaf(self, node: HiTreeNode) -> bool:
        return (
            node.on_device
            and node.lock_ref == 0
            and all(c.value is None for c in node.children.values())
        )

    def _host_leaf(self, node: HiTreeNode) -> bool:
        return (
            node.host_value is not None
            and node.lock_ref == 0
            and node.backing_up is None
            and all(c.host_value is None for c in node.children.values())
        )

    def _leaves(self, pred: Callable[[HiTreeNode], bool]) -> list[HiTreeNode]:
        out, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if pred(node):
                out.append(node)
        return out

    def _drop_subtree(self, node: HiTreeNode) -> None:
        """Remove an unlocked device leaf and its host-only descendants from the tree."""
        self._free(node.value)
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            assert child.value is None and child.lock_ref == 0
            self.host_pool.free(child.host_value)
            stack.extend(child.children.values())
        del node.parent.children[self._child_key(node.key)]

    def _split_node(self, child: TreeNode, n: int) -> TreeNode:
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = HiTreeNode(child.key[:n], None, parent, child.creation_time)
        for attr in ("lock_ref", "last_access_time", "hit_count", "priority"):
            setattr(upper, attr, getattr(child, attr))
        upper.loading, upper.backing_up = child.loading, child.backing_up
        if child.value is not None:
            upper.value, child.value = child.value[:n], child.value[n:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.parent = child.key[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ---- integrity (hicache_integrity) ---------------------------------------------------------

    def check_integrity(self) -> None:
        check_tiers(self)
        reads = [(k, op) for op in self.ops if op.kind == STORAGE_READ for k in op.keys]
        assert dict(reads) == self._reading and len(reads) == len(self._reading), (
            "a storage block read twice, or its read in flight not indexed"
        )

    def check_drained(self) -> None:
        check_tiers_drained(self)

    def host_evictable_size(self) -> int:
        return host_unlocked_tokens(self)


def create_hiradix_cache(
    server_args: Any,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    kv_pool: Any,
    model_path: str,
    context_len: int,
    clock: Callable[[], float] | None = None,
) -> HiRadixCache:
    """The Scheduler's tree cache with --enable-hierarchical-cache (`model_path`: the model the
    runner loaded, part of the storage tier's namespace; `context_len`: the longest request)."""
    from radixserve.mem_cache.hicache_storage import (
        check_block_size,
        create_storage,
        model_identity,
    )

    sa = server_args
    if sa.hicache_storage_backend is not None:
        check_block_size(sa.hicache_storage_block_size, context_len, allocator.size)
    buffers = device_kv_buffers(kv_pool)
    size = host_pool_tokens(
        allocator.size,
        buffer_bytes_per_token(buffers),
        sa.hicache_ratio,
        sa.hicache_size,
        sa.page_size,
        replicas=sa.dp_size,  # (all on this host: the hierarchical cache refuses TP, so nnodes)
    )
    host_pool = HostKVPool(buffers, size, sa.page_size)
    storage = None
    if sa.hicache_storage_backend is not None:
        storage = create_storage(
            sa.hicache_storage_backend,
            sa.hicache_storage_dir,
            model_identity(sa, model_path),
            buffers,
            sa.hicache_storage_block_size,
        )
    logger.info(
        "hierarchical cache: host tier %d tokens (%.1f MiB), %s, storage %s",
        size,
        size * buffer_bytes_per_token(buffers) / 2**20,
        sa.hicache_write_policy,
        storage.dir if storage is not None and hasattr(storage, "dir") else None,
    )
    return HiRadixCache(
        req_to_token_pool,
        allocator,
        host_pool,
        sa.page_size,
        sa.radix_eviction_policy,
        clock or time.monotonic,
        sa.hicache_write_policy,
        storage,
        sa.hicache_storage_block_size,
    )
