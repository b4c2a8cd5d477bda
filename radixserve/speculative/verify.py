"""Acceptance of draft trees against the target's logits (seed 000 §15.5–15.6).

Every node's logits go through the request's own logits processors with the history the node
stands for (the output so far plus the drafts on its path), so penalties and min_new_tokens
apply exactly as they would token by token. Then, per request, from the root:

* greedy rows: the target's argmax at the node; the child carrying that token is accepted and
  the walk goes on; otherwise the argmax is the bonus token and the walk stops;
* sampled rows: rejection sampling against the target distribution p at the node (after
  temperature, top-k/top-p/min-p). With deterministic drafts (NGRAM: q is a point mass) the
  children are tried in turn, child c accepted with probability r(c) under the residual r
  (p with the rejected children removed, renormalised); with a draft model's q (STANDALONE, one
  child) the draft d is accepted with probability min(1, p(d) / q(d)), and on rejection the
  bonus is drawn from the residual max(p − q, 0). Either way the committed token has exactly
  the target's distribution. A walk that reaches a leaf draws the bonus from p there.

Seeded requests draw from generators fixed by (seed, output position), as the plain sampler
does, so they reproduce whatever they are batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.sampler import (
    SamplingBatchInfo,
    argmax_rows,
    sampling_probs,
    seeded_generator,
)
from radixserve.speculative.spec_info import DraftTree, SpecVerifyOutput


@dataclass
class NodeView:
    """A verify node as the logits processors see a request: its history ends at the node."""

    sampling_params: Any
    origin_input_ids: list[int]
    output_ids: list[int]
    eos_token_ids: Sequence[int]
    grammar: Any = None


def node_views(reqs: Sequence[Any], trees: Sequence[DraftTree]) -> list[NodeView]:
    views = []
    for req, tree in zip(reqs, trees, strict=True):
        for node in range(len(tree)):
            drafts = [tree.tokens[i] for i in tree.path(node)]
            views.append(
                NodeView(
                    req.sampling_params,
                    req.origin_input_ids,
                    req.output_ids + drafts if drafts else req.output_ids,
                    req.eos_token_ids,
                    req.grammar if node == 0 else None,
                )
            )
    return views


def verify_trees(
    logits: torch.Tensor,
    reqs: Sequence[Any],
    trees: Sequence[DraftTree],
    vocab_size: int,
    vocab_mask: torch.Tensor | None = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    cpu_kernels: bool = False,
) -> SpecVerifyOutput:
    """`logits` [num_nodes, V]: the target's logits of every node, trees back to back.
    `vocab_mask` [B, V] (grammar) applies to the root rows (grammar requests draft nothing).
    `cpu_kernels`: the argmax through radixserve's kernel (the target runs the fused ops)."""
    views = node_views(reqs, trees)
    info = SamplingBatchInfo.from_reqs(views, vocab_size, str(logits.device))
    starts = [0]
    for t in trees:
        starts.append(starts[-1] + len(t))
    if vocab_mask is not None:
        full = torch.zeros(len(views), vocab_mask.shape[1], dtype=torch.bool)
        full[torch.tensor(starts[:-1])] = vocab_mask.cpu()
        info.vocab_mask = full.to(logits.device)
    logits = info.apply_logits_processors(logits.float())
    argmax = argmax_rows(logits, cpu_kernels).tolist()
    probs = None if info.is_all_greedy else sampling_probs(logits, info)
    greedy = info.greedy.tolist()
    out = SpecVerifyOutput([], [])
    for b, tree in enumerate(trees):
        base = starts[b]
        if greedy[base]:
            nodes, bonus = _accept_greedy(tree, argmax, base)
        else:
            seed = info.seeds[base]
            nodes, bonus = _accept_sampled(tree, probs, base, seed, info.steps[base])
        out.accepted_nodes.append(nodes)
        out.tokens.append([tree.tokens[i] for i in nodes] + [bonus])
    if return_logprob:
        _add_logprobs(out, logits, starts, top_logprobs_num)
    return out


def _accept_greedy(tree: DraftTree, argmax: list[int], base: int) -> tuple[list[int], int]:
    node, nodes = 0, []
    while True:
        want = argmax[base + node]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == want), None)
        if nxt is None:
            return nodes, want
        nodes.append(nxt)
        node = nxt


def _accept_sampled(
    tree: DraftTree, probs: torch.Tensor, base: int, seed: int | None, step: int
) -> tuple[list[int], int]:
    node, nodes = 0, []
    while True:
        pos = step + len(nodes)  # output position of the token decided here
        gen = _generator(seed, pos, probs.device)
        p = probs[base + node]
        kids = tree.children[node]
        if not kids:
            return nodes, _draw(p, gen)
        if tree.draft_probs is not None:  # a draft model's chain: one child drawn from q
            (child,) = kids
            q = tree.draft_probs[child - 1].to(p.device)
            d = tree.tokens[child]
            ratio = float(p[d]) / max(float(q[d]), 1e-30)
            if _uniform(gen, p.device) < min(1.0, ratio):
                nodes.append(child)
                node = child
                continue
            residual = (p - q).clamp_min(0.0)
            return nodes, _draw(residual if float(residual.sum()) > 0 else p, gen)
        residual = p.clone()
        accepted = None
        for child in kids:  # deterministic drafts, distinct tokens
            d = tree.tokens[child]
            total = float(residual.sum())
            if total <= 0:
                break
            if _uniform(gen, p.device) < float(residual[d]) / total:
                accepted = child
                break
            residual[d] = 0.0
        if accepted is None:
            return nodes, _draw(residual if float(residual.sum()) > 0 else p, gen)
        nodes.append(accepted)
        node = accepted


def _generator(seed: int | None, pos: int, device: torch.device) -> torch.Generator | None:
    return None if seed is None else seeded_generator(seed, pos, device)


def _uniform(gen: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=gen, device=device))


def _draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=gen))


def _add_logprobs(
    out: SpecVerifyOutput, logits: torch.Tensor, starts: list[int], top_logprobs_num: int
) -> None:
    """Log-probabilities of the committed tokens under the processed target logits (the same
    quantity the plain sampler reports); the bonus token's row is the last accepted node."""
    logprobs = torch.log_softmax(logits, dim=-1)
    out.logprobs, out.top_logprobs = [], []
    for b, (nodes, tokens) in enumerate(zip(out.accepted_nodes, out.tokens, strict=True)):
        rows = [starts[b] + n for n in [0, *nodes]]  # node whose logits decided each token
        idx = torch.tensor(rows)
        vals = logprobs[idx, torch.tensor(tokens)].tolist()
        out.logprobs.append(vals)
        if top_logprobs_num > 0:
            tv, ti = logprobs[idx].topk(top_logprobs_num, dim=-1)
            out.top_logprobs.append(
                [
                    list(zip(v, i, strict=True))
                    for v, i in zip(tv.tolist(), ti.tolist(), strict=True)
                ]
            )
        else:
            out.top_logprobs.append([])
