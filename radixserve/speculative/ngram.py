"""NGRAM proposals: continuations of the text's own recurring suffixes (seed 000 §15.8).

Each request keeps an index of where every token occurs in its prompt and output. To propose,
the text's last token is looked up; at each earlier occurrence the match is extended backwards
(up to the max match window) and kept when it reaches the min window. The best matches (longest,
then most recent) contribute their continuations, `branch_length` tokens each, merged into a
trie; the verify tree is the trie's highest-weighted nodes (a node's weight is the total weight
of the matches that continue through it; a match of length m weighs 4^(m-1), so one long match
outranks many one-token coincidences), at most `num_draft_tokens - 1` of them, parents first.
No draft model and no draft KV: proposing costs a few dictionary lookups per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.speculative.spec_info import DraftTree

MAX_OCCURRENCES = 64  # most recent occurrences of the last token examined per proposal


@dataclass(frozen=True)
class NgramConfig:
    min_window: int = 1
    max_window: int = 12
    max_breadth: int = 4
    branch_length: int = 18


class NgramIndex:
    """Token positions of one request's text (prompt then output), extended as tokens commit."""

    def __init__(self, tokens: list[int], config: NgramConfig) -> None:
        self.config = config
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        base = len(self.tokens)
        self.tokens.extend(tokens)
        for i, t in enumerate(tokens):
            self.where.setdefault(t, []).append(base + i)

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Catch up with the request's text (its prompt, then its output so far)."""
        n, p = len(self.tokens), len(prompt)
        if n < p:
            self.extend(prompt[n:])
            n = p
        if n - p < len(output):
            self.extend(output[n - p :])

    def propose(self, max_drafts: int) -> DraftTree:
        """A verify tree rooted at the last token, with at most `max_drafts` draft nodes."""
        toks = self.tokens
        n = len(toks)
        root = toks[-1]
        if max_drafts <= 0 or n < 2:
            return DraftTree.root_only(root)
        cfg = self.config
        matches: list[tuple[int, int]] = []  # (match length, position of the matched last token)
        for p in reversed(self.where.get(root, ())[-MAX_OCCURRENCES - 1 :]):
            if p >= n - 1:
                continue  # the last token itself
            m = 1
            while m < cfg.max_window and p - m >= 0 and toks[p - m] == toks[n - 1 - m]:
                m += 1
            if m >= cfg.min_window:
                matches.append((m, p))
        if not matches:
            return DraftTree.root_only(root)
        matches.sort(key=lambda mp: (mp[0], mp[1]), reverse=True)
        # Trie of the best continuations: node -> {token: child}, with each node's weight.
        children: list[dict[int, int]] = [{}]
        node_token, node_parent, weight = [root], [-1], [0.0]
        for m, p in matches[: cfg.max_breadth]:
            w = 4.0 ** min(m - 1, 30)
            node = 0
            for t in toks[p + 1 : p + 1 + min(cfg.branch_length, max_drafts)]:
                child = children[node].get(t)
                if child is None:
                    child = len(node_token)
                    children[node][t] = child
                    children.append({})
                    node_token.append(t)
                    node_parent.append(node)
                    weight.append(0.0)
                weight[child] += w
                node = child
        # Keep the heaviest nodes; a child never outweighs its parent, and ties keep the
        # shallower (earlier-created) node, so the kept set is closed under parents.
        order = sorted(range(1, len(node_token)), key=lambda i: (-weight[i], i))[:max_drafts]
        keep = sorted(order, key=lambda i: (_depth(node_parent, i), i))
        new_index = {0: 0}
        tokens, parents = [root], [-1]
        for i in keep:
            new_index[i] = len(tokens)
            tokens.append(node_token[i])
            parents.append(new_index[node_parent[i]])
        return DraftTree(tokens, parents)


def _depth(parents: list[int], i: int) -> int:
    d = 0
    while i > 0:
        i = parents[i]
        d += 1
    return d
