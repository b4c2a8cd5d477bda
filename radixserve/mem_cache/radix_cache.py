"""The radix prefix cache: a compressed prefix tree from token ids to KV slots (DESIGN §3).

Owns RadixKey, TreeNode, MatchResult and RadixCache. The Scheduler calls `match_prefix` when a
request is admitted, `cache_unfinished_req` after each intermediate prefill chunk,
`cache_finished_req` when a request ends or is retracted, and `evict` when the allocator runs
short. Slots owned by the tree are freed into the TokenToKVPoolAllocator only by `evict`.

Invariants (checked by `check_integrity`):
* every edge is a non-empty, page-aligned run of tokens; a node's dict key in its parent is
  `(extra_key, first page of its tokens)`, so different extra_keys never share a node;
* `evictable_size` is the token count of nodes with lock_ref == 0, `protected_size` of nodes with
  lock_ref > 0; locks are taken on whole root paths, so a parent's lock_ref >= its children's;
* no KV slot appears twice in the tree.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.mem_cache.evict_policy import get_evict_key_fn
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

ChildKey = tuple[str | None, tuple[int, ...]]


@dataclass
class RadixKey:
    """Token ids plus a namespace (LoRA id, cache salt); keys with different extra_key never
    match each other."""

    token_ids: list[int]
    extra_key: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, s: slice) -> RadixKey:
        return RadixKey(self.token_ids[s], self.extra_key)


class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in the `value` slots."""

    def __init__(self, key: RadixKey, value: torch.Tensor, parent: TreeNode | None, now: float):
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, hits={self.hit_count})"


@dataclass
class MatchResult:
    """Slots of the longest cached prefix and the node where that prefix ends (root if none)."""

    device_indices: torch.Tensor
    last_node: TreeNode


def match_length(a: list[int], b: list[int], page_size: int) -> int:
    """Length of the common prefix of a and b, rounded down to whole pages.

    Galloping search compares doubling runs of pages as list slices (one C-level comparison
    each), then a binary search narrows the first mismatching run to the last matching page.
    """
    n_pages = min(len(a), len(b)) // page_size
    lo, step = 0, 1  # pages [0, lo) are known to match
    while lo < n_pages:
        hi = min(lo + step, n_pages)
        if a[lo * page_size : hi * page_size] != b[lo * page_size : hi * page_size]:
            break
        lo, step = hi, step * 2
    else:
        return n_pages * page_size
    # A mismatch lies in pages [lo, hi): find the largest mid with pages [lo, mid) equal.
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * page_size : mid * page_size] == b[lo * page_size : mid * page_size]:
            lo = mid
        else:
            hi = mid
    return lo * page_size


class RadixCache:
    """Prefix tree over KV slots with lock-protected sharing and policy-ordered eviction."""

    disabled = False

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator | None,
        page_size: int = 1,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Both pools may be None for a scratch tree (the scheduler's in-batch prefix check) that
        only matches and inserts; evicting or caching requests needs them."""
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.evict_key = get_evict_key_fn(eviction_policy)
        self.clock = clock
        self.device = req_to_token_pool.device if req_to_token_pool is not None else "cpu"
        self.reset()

    # ---- tree operations -------------------------------------------------------------------

    def reset(self) -> None:
        """Drop the whole tree. Frees no slots: the scheduler calls this from flush_cache when no
        request runs and clears the allocator (and req_to_token pool) itself."""
        self.root_node = TreeNode(RadixKey([]), self._empty(), None, self.clock())
        self._evictable_size = 0
        self._protected_size = 0

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Longest cached page-aligned prefix of key. Splits the last edge when the match ends
        inside it, so last_node ends exactly at the match. Touches last_access_time only."""
        key = key[: len(key) // self.page_size * self.page_size]
        now = self.clock()
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = match_length(child.key.token_ids, key.token_ids, self.page_size)
            if n < len(child.key):
                child = self._split_node(child, n)
            values.append(child.value)
            node = child
            key = key[n:]
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, last_node=node)

    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor,
        priority: int | None = None,
        bump_hit: bool = True,
    ) -> int:
        """Insert key -> value (aligned, page-aligned length). Returns how many leading tokens were
        already cached: the tree keeps its own slots there and the caller must free its duplicate
        slots for that range. The tree takes ownership of value[returned:]."""
        assert len(key) == len(value), "key and value must be aligned"
        assert len(key) % self.page_size == 0, "insert expects a page-aligned key"
        now = self.clock()
        node = self.root_node
        prefix_len = 0
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = match_length(child.key.token_ids, key.token_ids, self.page_size)
            if n < len(child.key):
                child = self._split_node(child, n)
            self._touch(child, now, priority, bump_hit)
            prefix_len += n
            node = child
            key, value = key[n:], value[n:]
        if len(key):
            leaf = TreeNode(key, value.clone(), node, now)
            leaf.hit_count = int(bump_hit)
            leaf.priority = priority if priority is not None else 0
            node.children[self._child_key(key)] = leaf
            self._evictable_size += len(key)
        return prefix_len

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock node and its ancestors. Returns the tokens moved from evictable to protected."""
        moved = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                n = self._device_len(node)
                self._evictable_size -= n
                self._protected_size += n
                moved += n
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        return moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock node and its ancestors. Returns the tokens moved from protected to evictable."""
        moved = 0
        while node is not self.root_node:
            assert node.lock_ref > 0, "dec_lock_ref on an unlocked node"
            if node.lock_ref == 1:
                n = self._device_len(node)
                self._protected_size -= n
                self._evictable_size += n
                moved += n
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]
        return moved

    @staticmethod
    def _device_len(node: TreeNode) -> int:
        """Tokens of node that count as evictable or protected (all of them here)."""
        return len(node.key)

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens tree slots (if that many are evictable) from unlocked leaves,
        smallest policy key first. A parent left childless and unlocked becomes a candidate."""
        tiebreak = itertools.count()
        heap = [(self.evict_key(n), next(tiebreak), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self._free(node.value)
            evicted += len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            self._evictable_size -= len(node.key)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self.evict_key(parent), next(tiebreak), parent))
        return evicted

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- request bookkeeping ---------------------------------------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Hand a finished (or, with is_insert=False, retracted/aborted) request's KV to the tree,
        free what the tree does not keep, release its row and its lock."""
        kv_indices = self._req_slots(req, req.kv_allocated_len)
        if is_insert:
            # (a prompt-only request, max_new_tokens 0, finished in the overlap loop has its
            # dropped token's slot committed too: only slots with a token are inserted)
            token_ids = (req.origin_input_ids + req.output_ids)[: req.kv_committed_len]
            aligned = len(token_ids) // self.page_size * self.page_size
            key = RadixKey(token_ids[:aligned], req.extra_key)
            new_prefix_len = self.insert(key, kv_indices[:aligned].clone(), req.priority)
            self._free(kv_indices[req.cache_protected_len : new_prefix_len])
            self._free(kv_indices[aligned:])
        else:
            self._free(kv_indices[req.cache_protected_len :])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any) -> None:
        """After an intermediate prefill chunk: insert the computed page-aligned prefix, switch the
        request onto the tree's canonical slots and move its lock to the new last node. The
        unaligned tail stays private to the request (in prefix_indices, not in the tree)."""
        token_ids = req.fill_ids
        n = len(token_ids)
        row = req.req_pool_idx
        kv_indices = self._req_slots(req, n)
        aligned = n // self.page_size * self.page_size
        key = RadixKey(token_ids[:aligned], req.extra_key)
        new_prefix_len = self.insert(key, kv_indices[:aligned].clone(), bump_hit=False)
        self._free(kv_indices[req.cache_protected_len : new_prefix_len])

        new = self.match_prefix(key)
        new_len = len(new.device_indices)
        start = req.cache_protected_len
        self.req_to_token_pool.write(row, start, new.device_indices[start:])
        self.inc_lock_ref(new.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([new.device_indices, kv_indices[new_len:]])
        req.cache_protected_len = new_len
        req.last_node = new.last_node

    # ---- debugging -------------------------------------------------------------------------

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            toks = node.key.token_ids
            shown = f"{toks[:8]}{'...' if len(toks) > 8 else ''}"
            ns = f" ns={node.key.extra_key!r}" if node.key.extra_key is not None else ""
            lines.append(
                f"{'  ' * depth}[{len(toks)}] {shown}{ns} lock={node.lock_ref} "
                f"hits={node.hit_count}"
            )
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        lines.append(f"evictable={self._evictable_size} protected={self._protected_size}")
        return "\n".join(lines)

    def check_integrity(self) -> None:
        evictable = protected = 0
        values: list[torch.Tensor] = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            assert node.lock_ref >= 0, "negative lock_ref"
            for ck, child in node.children.items():
                assert len(child.key) > 0, "empty edge"
                assert len(child.key) % self.page_size == 0, "edge not page-aligned"
                assert ck == self._child_key(child.key), "child dict key != first page of edge"
                assert child.parent is node, "broken parent link"
                assert len(child.value) == len(child.key), "value/key length mismatch"
                if node is not self.root_node:
                    assert node.lock_ref >= child.lock_ref, "child locked more than its parent"
                    assert child.key.extra_key == node.key.extra_key, "extra_key changes on path"
                if child.lock_ref > 0:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                values.append(child.value)
                stack.append(child)
        assert evictable == self._evictable_size, f"evictable {self._evictable_size}!={evictable}"
        assert protected == self._protected_size, f"protected {self._protected_size}!={protected}"
        if values:
            slots = torch.cat(values)
            assert len(torch.unique(slots)) == len(slots), "a KV slot appears twice in the tree"

    # ---- helpers ---------------------------------------------------------------------------

    def _child_key(self, key: RadixKey) -> ChildKey:
        return (key.extra_key, tuple(key.token_ids[: self.page_size]))

    def _split_node(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; return the new upper node, which takes child's place.
        Both halves keep child's lock_ref and stats, so the size accounting is unchanged."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.creation_time)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    @staticmethod
    def _touch(node: TreeNode, now: float, priority: int | None, bump_hit: bool) -> None:
        node.last_access_time = now
        if bump_hit:
            node.hit_count += 1
        if priority is not None:
            # The most important request that used a prefix decides how long it is kept.
            node.priority = max(node.priority, priority)

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _req_slots(self, req: Any, length: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :length].to(torch.int64)

    def _free(self, indices: torch.Tensor) -> None:
        if indices.numel() and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(indices)

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)
