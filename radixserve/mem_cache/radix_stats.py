"""A bounded summary of the radix tree for the dashboard: node count, depth and the largest
shared prefixes. The Scheduler calls `tree_stats` only when a dashboard snapshot is asked for.

The walk is breadth-first and stops after `max_nodes` nodes, so its cost never depends on the
size of the tree; prefixes near the root (the widely shared ones) are visited first. When it
stops early `truncated` is true and counts below the cut are lower bounds.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import islice
from typing import Any

from radixserve.mem_cache.radix_cache import TreeNode

MAX_NODES = 4096
TOP_K = 5
PREVIEW_TOKENS = 24  # from each end of a prefix


def tree_stats(
    root: TreeNode,
    max_nodes: int = MAX_NODES,
    top_k: int = TOP_K,
    preview_tokens: int = PREVIEW_TOKENS,
) -> dict[str, Any]:
    """Nodes (below the root) and depth of the visited part, and the `top_k` prefixes with the
    most leaves under them (ties: the longer prefix first), each the longest prefix its leaves
    share (a node whose leaves all lie under one child is skipped for that child), with its
    length in tokens, leaves, hit_count, lock_ref (running requests that hold it) and its first
    and last token ids (head_ids, tail_ids: `preview_tokens` each; tail_ids is empty when
    head_ids holds the whole prefix)."""
    visited: list[tuple[TreeNode, int, int]] = []  # (node, depth in edges, depth in tokens)
    queue: deque[tuple[TreeNode, int, int]] = deque([(root, 0, 0)])
    truncated = False
    while queue:
        node, depth, tokens = queue.popleft()
        visited.append((node, depth, tokens))
        room = max_nodes + 1 - len(visited) - len(queue)  # +1: the root is not counted
        if len(node.children) > room:
            truncated = True
        for child in islice(node.children.values(), max(room, 0)):
            queue.append((child, depth + 1, tokens + len(child.key)))
    leaves: dict[int, int] = {}  # id(node) -> leaves under it (its visited children's sum)
    widest_child: dict[int, int] = {}  # id(node) -> most leaves under one of its children
    for node, _, _ in reversed(visited):  # children before their parents
        n = leaves[id(node)] = leaves.get(id(node), 0) if node.children else 1
        if node.parent is not None:
            up = id(node.parent)
            leaves[up] = leaves.get(up, 0) + n
            widest_child[up] = max(widest_child.get(up, 0), n)
    nodes = visited[1:]
    # A node that passes all its leaves on to one child is not the longest prefix they share.
    ends = [v for v in nodes if widest_child.get(id(v[0]), 0) < leaves[id(v[0])]]
    top = heapq.nlargest(top_k, ends, key=lambda v: (leaves[id(v[0])], v[2]))
    return {
        "nodes": len(nodes),
        "depth": max((v[1] for v in nodes), default=0),
        "depth_tokens": max((v[2] for v in nodes), default=0),
        "leaves": leaves[id(root)] if root.children else 0,
        "truncated": truncated,
        "top_prefixes": [
            _prefix_row(node, tokens, leaves[id(node)], preview_tokens) for node, _, tokens in top
        ],
    }


def merge_tree_stats(trees: list[dict[str, Any]], top_k: int = TOP_K) -> dict[str, Any]:
    """tree_stats of the data-parallel replicas' trees as one: counts summed, depths the
    deepest, and the `top_k` prefixes of them all (each row names its replica)."""
    rows = [
        {**row, "replica": rank} for rank, tree in enumerate(trees) for row in tree["top_prefixes"]
    ]
    return {
        "nodes": sum(t["nodes"] for t in trees),
        "depth": max(t["depth"] for t in trees),
        "depth_tokens": max(t["depth_tokens"] for t in trees),
        "leaves": sum(t["leaves"] for t in trees),
        "truncated": any(t["truncated"] for t in trees),
        "top_prefixes": heapq.nlargest(top_k, rows, key=lambda r: (r["leaves"], r["tokens"])),
    }


def _prefix_row(node: TreeNode, tokens: int, leaves: int, preview_tokens: int) -> dict[str, Any]:
    head, tail = prefix_ends(node, preview_tokens)
    return {
        "tokens": tokens,
        "leaves": leaves,
        "hits": node.hit_count,
        "locks": node.lock_ref,
        "extra_key": node.key.extra_key,
        "head_ids": head,
        "tail_ids": tail,
    }


def prefix_ends(node: TreeNode, n: int) -> tuple[list[int], list[int]]:
    """The first n and the last n token ids of the path from the root to `node` (the last ones
    only where the path is longer than 2n; else the first 2n hold all of it)."""
    path = []
    while node.parent is not None:
        path.append(node.key.token_ids)
        node = node.parent
    path.reverse()
    total = sum(len(ids) for ids in path)
    head = _take(path, 2 * n if total <= 2 * n else n)
    tail = [] if total <= 2 * n else _take([ids[::-1] for ids in reversed(path)], n)[::-1]
    return head, tail


def _take(runs: list[list[int]], n: int) -> list[int]:
    """The first n ids of the runs laid end to end."""
    out: list[int] = []
    for ids in runs:
        out.extend(ids[: n - len(out)])
        if len(out) >= n:
            break
    return out
