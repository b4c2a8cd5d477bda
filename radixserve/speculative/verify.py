"""Acceptance of draft trees against the target's logits (seed 000 §15.5–15.6).

Every node's logits go through the request's own logits processors with the history the node
stands for (the output so far plus the drafts on its path), so penalties and min_new_tokens
apply exactly as they would token by token. Then, per request, from the root:

* greedy rows: the target's argmax at the node; the child carrying that token is accepted and
  the walk goes on; otherwise the argmax is the bonus token and the walk stops;
* sampled rows: the token the plain sampler would draw from the target distribution p at
  the node (after temperature, top-k/top-p/min-p) is drawn, and the child carrying it is
  accepted; otherwise it is the bonus token and the walk stops. For deterministic drafts
  (NGRAM: q is a point mass) this is rejection sampling itself. For a draft model's chain
  (STANDALONE, one child) an unseeded row instead accepts the draft d with probability
  min(1, p(d) / q(d)) and on rejection draws the bonus from the residual max(p − q, 0). Either
  way the committed token has exactly the target's distribution.

Seeded requests draw from generators fixed by (seed, output position), with the plain
sampler's draw; a draft model drafts for them with the same position's noise (a coupling that
accepts the draft wherever p and q pick the same token). So a seeded request's tokens are the
ones it gets without speculation, whatever it is batched with and whether or not it drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.sampler import (
    SamplingBatchInfo,
    argmax_rows,
    inverse_cdf_draw,
    sampling_probs,
    seeded_draw,
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
        p = probs[base + node]
        kids = tree.children[node]
        if kids and tree.draft_probs is not None and seed is None:
            # A draft model's chain: its one child drawn from q, accepted with min(1, p/q).
            (child,) = kids
            q = tree.draft_probs[child - 1].to(p.device)
            # top-k / top-p / min-p leave each distribution with less than all its mass: the
            # ratio and the residual compare normalised ones (p's kept mass scaled acceptance)
            p, q = p / p.sum(), q / q.sum()
            d = tree.tokens[child]
            ratio = float(p[d]) / max(float(q[d]), 1e-30)
            if float(torch.rand(())) < min(1.0, ratio):
                nodes.append(child)
                node = child
                continue
            residual = (p - q).clamp_min(0.0)
            return nodes, _draw(residual if float(residual.sum()) > 0 else p, None, pos)
        # The token the plain sampler would draw here; the child carrying it, if any, is
        # accepted (deterministic drafts, and a seeded request's drafts, drawn with this same
        # position's noise: spec_worker.draft_sample).
        token = _draw(p, seed, pos)
        child = next((c for c in kids if tree.tokens[c] == token), None)
        if child is None:
            return nodes, token
        nodes.append(child)
        node = child


def _draw(p: torch.Tensor, seed: int | None, pos: int) -> int:
    """One token from p as the plain sampler draws it: from the generator of (seed, output
    position) for a seeded request, else from torch's global one."""
    if seed is not None:
        return int(seeded_draw(p, seed, pos))
    return int(inverse_cdf_draw(p.view(1, -1))[0])


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
