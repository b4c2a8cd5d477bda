"""The hierarchical cache's invariants, executable (DESIGN §5, invariant 12 over three tiers).

Called by HiRadixCache.check_integrity (every step with --enable-integrity-checks) and by the
scheduler's drain check. Checks, over the whole tree:
* every node has a device or a host copy; a device node's parent is on the device (or root);
* edges are non-empty whole pages, links and child keys agree, locks never grow downwards;
* evictable / protected equal the tree's unlocked / locked device tokens;
* no device slot and no host slot appears twice;
* host slots: free + in the tree + held by storage reads in flight == the host pool's size;
* a loading or backing-up node is locked and its copy is in flight.
Drained: no copy in flight and no lock on any node, host-only ones included.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.mem_cache.cache_controller import STORAGE_READ


def check_tiers(cache: Any) -> None:
    evictable = protected = host_tokens = 0
    dev: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    root = cache.root_node
    stack = [root]
    while stack:
        node = stack.pop()
        for ck, c in node.children.items():
            assert len(c.key) > 0 and len(c.key) % cache.page_size == 0, "bad edge"
            assert ck == cache._child_key(c.key) and c.parent is node, "broken link"
            assert c.value is not None or c.host_value is not None, "a node with no KV"
            if node is not root:
                assert node.lock_ref >= c.lock_ref, "child locked more than its parent"
                assert c.key.extra_key == node.key.extra_key, "extra_key changes on path"
            if c.value is not None:
                assert len(c.value) == len(c.key), "value/key length mismatch"
                assert node is root or node.value is not None, "a device node below a host one"
                protected += len(c.key) if c.lock_ref > 0 else 0
                evictable += len(c.key) if c.lock_ref == 0 else 0
                dev.append(c.value)
            if c.host_value is not None:
                assert len(c.host_value) == len(c.key), "host value/key length mismatch"
                host_tokens += len(c.key)
                host.append(c.host_value)
            for op in (c.loading, c.backing_up):
                assert op is None or (op in cache.ops and c.lock_ref > 0), "stray copy"
            assert c.loading is None or c.value is not None, "loading without slots"
            stack.append(c)
    assert evictable == cache.evictable_size(), f"evictable {cache.evictable_size()}!={evictable}"
    assert protected == cache.protected_size(), f"protected {cache.protected_size()}!={protected}"
    for slots, tier in ((dev, "device"), (host, "host")):
        if slots:
            cat = torch.cat(slots)
            assert len(torch.unique(cat)) == len(cat), f"a {tier} slot appears twice"
    reading = sum(len(op.host_indices) for op in cache.ops if op.kind == STORAGE_READ)
    pool = cache.host_pool
    free = pool.available_size()
    assert free + host_tokens + reading == pool.size, (
        f"host slots leaked: {free} free + {host_tokens} in tree + {reading} reading != {pool.size}"
    )
    pool.check_integrity()


def check_tiers_drained(cache: Any) -> None:
    assert not cache.ops, f"{len(cache.ops)} cache copies still in flight"
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        assert node.lock_ref == 0, "a radix node is still locked after drain"
        stack.extend(node.children.values())
    pool = cache.host_pool
    assert pool.available_size() + host_unlocked_tokens(cache) == pool.size, "host slots leaked"


def host_unlocked_tokens(cache: Any) -> int:
    """Host tokens of unlocked nodes: what host eviction could free."""
    stack, total = list(cache.root_node.children.values()), 0
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.host_value is not None and node.lock_ref == 0:
            total += len(node.key)
    return total
