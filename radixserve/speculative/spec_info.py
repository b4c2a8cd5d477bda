"""The speculative-decoding contract shared by every algorithm (seed 000 §15).

A verify step extends each request by a tree of draft tokens rooted at its last token (the one
whose KV is not written yet). The target model runs all nodes of all trees in one forward;
acceptance walks each tree from the root and commits the longest path the target agrees with,
plus one token of the target's own (the bonus). Only committed tokens ever reach the output,
the radix cache or a later step; the KV of every other node is freed when the result is
processed.

For the model, a verify step is a decode step with one query per node: node i of a request at
position `seq_len + depth(i)` attends its request's committed KV plus the slots of its own
ancestors, so each node gets its own row of KV slots (`node_kv_rows`) and no attention backend
needs a tree mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class SpecAlgorithm(Enum):
    NONE = "NONE"
    NGRAM = "NGRAM"
    STANDALONE = "STANDALONE"

    @classmethod
    def of(cls, name: str | None) -> SpecAlgorithm:
        return cls.NONE if name is None else cls(name.upper())

    def is_none(self) -> bool:
        return self is SpecAlgorithm.NONE

    def has_draft_model(self) -> bool:
        return self is SpecAlgorithm.STANDALONE


@dataclass
class DraftTree:
    """One request's verify tree. Node 0 is the root: the request's last token, already in its
    output. Nodes are numbered so that a parent comes before its children (BFS order)."""

    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    # STANDALONE: the draft distribution each non-root node's token was drawn from ([n-1, V]);
    # None for deterministic proposals (NGRAM), whose q is a point mass.
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.parents and self.parents[0] == -1, "node 0 must be the root"
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), "parents come first"
        self.depths = [0] * len(self.tokens)
        self.children: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            self.depths[i] = self.depths[self.parents[i]] + 1
            self.children[self.parents[i]].append(i)

    @classmethod
    def root_only(cls, token: int) -> DraftTree:
        return cls([token], [-1])

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), [i - 1 for i in range(len(tokens))])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Node indices from the first draft (depth 1) down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def truncate(self, depth: int) -> DraftTree:
        """The nodes at most `depth` deep (parents come first, so indices stay ordered)."""
        if depth >= max(self.depths):
            return self
        keep = [i for i, d in enumerate(self.depths) if d <= depth]
        index = {old: new for new, old in enumerate(keep)}
        parents = [index[self.parents[i]] if i else -1 for i in keep]
        tree = DraftTree([self.tokens[i] for i in keep], parents)
        if self.draft_probs is not None and len(keep) > 1:
            tree.draft_probs = self.draft_probs[[i - 1 for i in keep[1:]]]
        return tree

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i)


@dataclass
class SpecVerifyInput:
    """spec_info of a verify step: carried by the ScheduleBatch, its ModelWorkerBatch and its
    result. `trees[b]` belongs to the batch's request b; its nodes occupy the request's row
    positions seq_lens[b] .. seq_lens[b] + len(tree) - 1 (slots allocated by the scheduler)."""

    trees: list[DraftTree]
    seq_lens: list[int]  # committed KV length of each request before the step
    # STANDALONE: what the draft model must catch up on before drafting (tokens whose draft KV
    # is missing, the root included), per request.
    draft_catch_up: list[list[int]] = field(default_factory=list)
    draft_kv_lens: list[int] = field(default_factory=list)

    @property
    def num_nodes(self) -> int:
        return sum(len(t) for t in self.trees)

    def node_kv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[num_nodes, width] KV slots per node: the committed prefix of its request's row, then
        its ancestors' slots and its own (tree attention as a decode of one query per node).
        `rows` are the requests' req_to_token rows, copied at launch; entries past a node's
        length (seq_len + depth + 1) are never read."""
        width = max(s + max(t.depths) + 1 for s, t in zip(self.seq_lens, self.trees, strict=True))
        owner, dst_row, dst_col, src_col = [], [], [], []
        i = 0
        for b, (s, tree) in enumerate(zip(self.seq_lens, self.trees, strict=True)):
            for node in range(len(tree)):
                owner.append(b)
                for k, anc in enumerate([0, *tree.path(node)]):
                    if anc != k:  # off the chain order: the slot of row position s + anc
                        dst_row.append(i)
                        dst_col.append(s + k)
                        src_col.append(s + anc)
                i += 1
        owner_t = torch.tensor(owner, dtype=torch.int64)
        out = rows[owner_t, :width].clone()
        if dst_row:
            rt = torch.tensor(dst_row, dtype=torch.int64)
            out[rt, torch.tensor(dst_col)] = rows[owner_t[rt], torch.tensor(src_col)]
        return out


@dataclass
class SpecVerifyOutput:
    """What acceptance decided for each request of the step."""

    accepted_nodes: list[list[int]]  # node indices of the accepted drafts, root excluded
    tokens: list[list[int]]  # committed tokens: accepted drafts then the bonus token
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[float, int]]]] | None = None
