"""NGRAM proposals: trees from the text's own recurring suffixes."""

from __future__ import annotations

from radixserve.speculative.ngram import NgramConfig, NgramIndex


def _index(tokens, **kw) -> NgramIndex:
    return NgramIndex(list(tokens), NgramConfig(**kw))


def test_a_repeated_block_is_proposed_as_its_continuation():
    block = [10, 11, 12, 13, 14, 15, 16, 17]
    ix = _index(block * 2 + block[:3])  # ... 10 11 12 | next should be 13 14 ...
    tree = ix.propose(5)
    assert tree.tokens == [12, 13, 14, 15, 16, 17]
    assert tree.is_chain()


def test_no_earlier_occurrence_proposes_nothing():
    tree = _index([1, 2, 3, 4, 5]).propose(7)
    assert tree.tokens == [5] and tree.num_drafts == 0


def test_budget_and_branch_length_cap_the_tree():
    ix = _index(list(range(20, 40)) * 3 + [20, 21], branch_length=3)
    assert ix.propose(7).num_drafts == 3  # one continuation of 3 tokens
    ix = _index(list(range(20, 40)) * 3 + [20, 21])
    assert ix.propose(2).num_drafts == 2


def test_min_window_rejects_short_matches():
    # 7 recurs, but preceded by different tokens: a match of length 1 only.
    text = [1, 7, 8, 2, 7, 9, 3, 7]
    assert _index(text, min_window=1).propose(4).num_drafts > 0
    assert _index(text, min_window=2).propose(4).num_drafts == 0


def test_diverging_continuations_form_a_tree_with_the_longest_match_first():
    # "5 6" continues with 1 after a 3-token match and with 2 after a 2-token match.
    text = [9, 5, 6, 1, 1, 1, 0, 4, 5, 6, 2, 2, 2, 0, 9, 5, 6]
    tree = _index(text, max_breadth=4, branch_length=3).propose(6)
    assert not tree.is_chain()
    first = [tree.tokens[c] for c in tree.children[0]]
    assert first[0] == 1 and 2 in first  # the heavier (longer-match) branch comes first
    for i, p in enumerate(tree.parents):
        assert p < i  # parents before children
    assert len(tree) == 7


def test_sync_extends_incrementally_like_a_fresh_index():
    prompt = [3, 4, 5, 6, 3, 4]
    output = [5, 6, 3, 4, 5]
    ix = NgramIndex([], NgramConfig())
    ix.sync(prompt, [])
    ix.sync(prompt, output[:2])
    ix.sync(prompt, output)
    fresh = _index(prompt + output)
    assert ix.tokens == fresh.tokens and ix.where == fresh.where
    assert ix.propose(4).tokens == fresh.propose(4).tokens
