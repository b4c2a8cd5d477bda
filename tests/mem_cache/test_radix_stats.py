"""tree_stats: the bounded walk of the radix tree behind the dashboard's tree panel."""

from __future__ import annotations

import torch

from radixserve.mem_cache.radix_cache import RadixCache, RadixKey
from radixserve.mem_cache.radix_stats import tree_stats


def _tree(keys: list[list[int]]) -> RadixCache:
    tree = RadixCache(None, None)
    slot = 0
    for key in keys:
        tree.insert(RadixKey(key), torch.arange(slot, slot + len(key)))
        slot += len(key)
    return tree


def test_tree_stats_ranks_prefixes_by_the_leaves_under_them():
    shared = list(range(10, 30))  # 20 tokens that 4 prompts share
    tails = [[40 + i, 50, 51] for i in range(4)]
    tree = _tree([shared + t for t in tails] + [shared[:5] + [99, 98]] + [[7, 8, 9]])
    stats = tree_stats(tree.root_node, top_k=3, preview_tokens=4)
    # root -> [10..14] -> {[15..29] -> 4 tails, [99, 98]}; root -> [7, 8, 9]
    assert stats["nodes"] == 1 + 1 + 4 + 1 + 1
    assert stats["leaves"] == 6 and stats["truncated"] is False
    assert stats["depth"] == 3 and stats["depth_tokens"] == 23
    top = stats["top_prefixes"]
    assert [(p["tokens"], p["leaves"]) for p in top] == [(5, 5), (20, 4), (23, 1)]
    assert (top[0]["head_ids"], top[0]["tail_ids"]) == (shared[:5], [])  # 5 <= 2 x 4 tokens
    assert (top[1]["head_ids"], top[1]["tail_ids"]) == (shared[:4], shared[-4:])
    assert (top[2]["head_ids"], top[2]["tail_ids"]) == (shared[:4], shared[-1:] + tails[0])


def test_tree_stats_visits_at_most_max_nodes():
    tree = _tree([[i, i + 1000] for i in range(300)] + [[5000] * 50])
    stats = tree_stats(tree.root_node, max_nodes=64)
    assert stats["nodes"] == 64 and stats["truncated"] is True
    assert tree_stats(tree.root_node)["nodes"] == 301
    empty = tree_stats(RadixCache(None, None).root_node)
    assert (empty["nodes"], empty["leaves"], empty["top_prefixes"]) == (0, 0, [])
