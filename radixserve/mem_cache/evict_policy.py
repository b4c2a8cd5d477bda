"""Eviction priority keys for the radix cache (DESIGN §3).

Each policy maps a tree node to a sortable key; RadixCache.evict pops the *smallest* key first.
The table is keyed by the `--radix-eviction-policy` name. Called only by RadixCache; it depends on
nothing but the node fields listed in `EvictableNode`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class EvictableNode(Protocol):
    """The TreeNode fields a policy may read."""

    last_access_time: float
    creation_time: float
    hit_count: int
    priority: int


EvictKey = tuple[float, ...]
EvictKeyFn = Callable[[EvictableNode], EvictKey]


def lru_key(node: EvictableNode) -> EvictKey:
    """Least recently used goes first."""
    return (node.last_access_time,)


def lfu_key(node: EvictableNode) -> EvictKey:
    """Least frequently used goes first; recency breaks ties."""
    return (node.hit_count, node.last_access_time)


def fifo_key(node: EvictableNode) -> EvictKey:
    """Oldest inserted goes first."""
    return (node.creation_time,)


def mru_key(node: EvictableNode) -> EvictKey:
    """Most recently used goes first."""
    return (-node.last_access_time,)


def filo_key(node: EvictableNode) -> EvictKey:
    """Newest inserted goes first."""
    return (-node.creation_time,)


def priority_key(node: EvictableNode) -> EvictKey:
    """Lowest request priority goes first; recency breaks ties."""
    return (node.priority, node.last_access_time)


def slru_key(node: EvictableNode) -> EvictKey:
    """Segmented LRU: the probationary segment (hit fewer than twice) goes before the protected
    segment; LRU order within a segment."""
    return (int(node.hit_count >= 2), node.last_access_time)


EVICTION_POLICIES: dict[str, EvictKeyFn] = {
    "lru": lru_key,
    "lfu": lfu_key,
    "fifo": fifo_key,
    "mru": mru_key,
    "filo": filo_key,
    "priority": priority_key,
    "slru": slru_key,
}


def get_evict_key_fn(policy: str) -> EvictKeyFn:
    """The key function for a policy name; raises ValueError for an unknown name."""
    try:
        return EVICTION_POLICIES[policy]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {policy!r}; expected one of {known}") from None
