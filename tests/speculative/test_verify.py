"""Acceptance over draft trees: greedy walks, and rejection sampling that reproduces the target
distribution exactly (deterministic NGRAM drafts and a draft model's q alike)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.sampling_params import SamplingParams
from radixserve.speculative.spec_info import DraftTree
from radixserve.speculative.verify import verify_trees

V = 6


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=lambda: [1, 2])
    output_ids: list[int] = field(default_factory=lambda: [3])
    eos_token_ids: tuple[int, ...] = ()
    grammar: object = None


def _logits_from(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


@pytest.mark.parametrize("cpu_kernels", [False, True])  # torch's argmax, radixserve's kernel
def test_greedy_walks_the_tree_and_adds_the_targets_bonus(cpu_kernels):
    if cpu_kernels:
        load_cpu_kernels()
    # Root 3 with children 4 and 5; 5 has child 0. Target argmax: root -> 5, node(5) -> 0,
    # node(0) -> 2 (the bonus).
    tree = DraftTree([3, 4, 5, 0], [-1, 0, 0, 2])
    rows = torch.full((4, V), -5.0)
    rows[0, 5] = rows[2, 0] = rows[3, 2] = 5.0
    rows[1, 1] = 5.0
    req = FakeReq(SamplingParams(temperature=0.0))
    out = verify_trees(rows, [req], [tree], V, cpu_kernels=cpu_kernels)
    assert out.accepted_nodes == [[2, 3]]
    assert out.tokens == [[5, 0, 2]]


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_greedy_rejects_at_the_root_and_commits_one_token(cpu_kernels):
    if cpu_kernels:
        load_cpu_kernels()
    tree = DraftTree.chain([3, 4, 4])
    rows = torch.zeros(3, V)
    rows[:, 1] = 1.0
    req = FakeReq(SamplingParams(temperature=0.0))
    out = verify_trees(rows, [req], [tree], V, cpu_kernels=cpu_kernels)
    assert out.tokens == [[1]] and out.accepted_nodes == [[]]


def test_min_new_tokens_is_enforced_per_node():
    """The EOS a node's logits prefer is banned while the path's output is still short."""
    tree = DraftTree.chain([3, 4])
    rows = torch.zeros(2, V)
    rows[0, 4] = 3.0
    rows[1, 2] = 3.0  # EOS (id 2) is the target's choice after the draft
    rows[1, 5] = 2.0
    sp = SamplingParams(temperature=0.0, min_new_tokens=3)
    req = FakeReq(sp, eos_token_ids=(2,))  # one output so far: the draft is the 2nd, EOS 3rd
    out = verify_trees(rows, [req], [tree], V)
    assert out.tokens == [[4, 5]]  # node 1 would be output 3: EOS still banned there
    req = FakeReq(SamplingParams(temperature=0.0, min_new_tokens=2), eos_token_ids=(2,))
    assert verify_trees(rows, [req], [tree], V).tokens == [[4, 2]]


BATCH = 200  # requests per verify call (one tree each): the draws are independent


def _draw_many(rows, req, tree_fn, n):
    """n independent verifications of one request's tree; returns their outputs."""
    outs = []
    while len(outs) < n:
        trees = [tree_fn() for _ in range(BATCH)]
        big = rows.repeat(BATCH, 1)
        res = verify_trees(big, [req] * BATCH, trees, V)
        outs.extend(zip(res.tokens, res.accepted_nodes, strict=True))
    return outs[:n]


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Pearson's chi-square with V-1 degrees of freedom, at p ≈ 1e-4 (critical 25.7 for 5)."""
    expected = probs * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token with zero target probability was produced"
    chi2 = float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    critical = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5, 5: 25.7}[dof]
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical} ({counts.tolist()} vs {expected})"


P_ROOT = [0.05, 0.30, 0.10, 0.25, 0.20, 0.10]
P_NODE = [0.40, 0.05, 0.15, 0.10, 0.20, 0.10]


@pytest.mark.parametrize("children", [[1], [1, 4], [5, 2, 3]], ids=["one", "two", "three"])
def test_rejection_sampling_with_deterministic_drafts_reproduces_the_target(children):
    """NGRAM: however many candidate tokens the root has, the first committed token is
    distributed as the target's p at the root, and the second (given the first draft was
    accepted) as p at that node."""
    torch.manual_seed(0)
    tokens = [3] + children + [0]
    parents = [-1] + [0] * len(children) + [1]
    tree = DraftTree(tokens, parents)
    rows = _logits_from([P_ROOT] + [P_NODE] * (len(children) + 1))
    req = FakeReq(SamplingParams(temperature=1.0))
    n = 8000
    first = torch.zeros(V)
    second = torch.zeros(V)
    for out, _ in _draw_many(rows, req, lambda: tree, n):
        first[out[0]] += 1
        if out[0] == children[0] and len(out) > 1:
            second[out[1]] += 1
    _chi2_ok(first, torch.tensor(P_ROOT), n)
    m = int(second.sum())
    assert m > 0.05 * n
    _chi2_ok(second, torch.tensor(P_NODE), m)


def _drafts_from(q: torch.Tensor):
    """A draft model's one-token chains: each draws its token from q and carries q."""

    def draft() -> DraftTree:
        tree = DraftTree.chain([3, int(torch.multinomial(q, 1))])
        tree.draft_probs = q.view(1, -1)
        return tree

    return draft


def test_rejection_sampling_with_a_draft_distribution_reproduces_the_target():
    """STANDALONE: drafts drawn from q, accepted with min(1, p/q), residual max(p - q, 0)."""
    torch.manual_seed(1)
    q = torch.tensor([0.30, 0.05, 0.05, 0.20, 0.10, 0.30])
    rows = _logits_from([P_ROOT, P_NODE])
    req = FakeReq(SamplingParams(temperature=1.0))
    n = 8000
    counts = torch.zeros(V)
    accepted = 0
    for tokens, nodes in _draw_many(rows, req, _drafts_from(q), n):
        counts[tokens[0]] += 1
        accepted += len(nodes)
    _chi2_ok(counts, torch.tensor(P_ROOT), n)
    # Acceptance rate is sum(min(p, q)).
    expect = float(torch.minimum(torch.tensor(P_ROOT), q).sum())
    assert math.isclose(accepted / n, expect, abs_tol=0.03)


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.5}])
def test_rejection_sampling_with_a_draft_distribution_under_filters(filters):
    """STANDALONE with top-k / top-p / min-p: the target's filtered probabilities were not
    renormalised before p/q and the residual, so acceptance shrank by the kept mass and the
    committed tokens followed neither p nor the filtered p."""
    torch.manual_seed(3)
    req = FakeReq(SamplingParams(temperature=1.0, **filters))
    p = torch.tensor(P_ROOT)
    keep = {"top_k": [1, 3, 4], "top_p": [1, 3, 4], "min_p": [1, 3, 4]}[next(iter(filters))]
    want = torch.zeros(V)
    want[keep] = p[keep] / p[keep].sum()
    q = torch.tensor([0.05, 0.15, 0.05, 0.45, 0.25, 0.05])  # a draft under the same filter
    q_kept = torch.zeros(V)
    q_kept[keep] = q[keep] / q[keep].sum()
    rows = _logits_from([P_ROOT, P_NODE])
    n = 8000
    counts = torch.zeros(V)
    for tokens, _ in _draw_many(rows, req, _drafts_from(q_kept), n):
        counts[tokens[0]] += 1
    _chi2_ok(counts, want, n)


def test_top_k_and_temperature_shape_the_target_distribution():
    torch.manual_seed(2)
    tree = DraftTree([3, 1, 4], [-1, 0, 0])
    rows = _logits_from([P_ROOT, P_NODE, P_NODE])
    req = FakeReq(SamplingParams(temperature=0.5, top_k=3))
    p = torch.tensor(P_ROOT) ** 2  # temperature 0.5 squares the probabilities
    keep = p.topk(3).indices
    want = torch.zeros(V)
    want[keep] = p[keep]
    want /= want.sum()
    n = 8000
    counts = torch.zeros(V)
    for tokens, _ in _draw_many(rows, req, lambda: tree, n):
        counts[tokens[0]] += 1
    _chi2_ok(counts, want, n)


def test_seeded_requests_reproduce_their_tokens():
    tree = DraftTree([3, 1, 4], [-1, 0, 0])
    rows = _logits_from([P_ROOT, P_NODE, P_NODE])
    req = FakeReq(SamplingParams(temperature=1.0, seed=7))
    runs = {tuple(verify_trees(rows, [req], [tree], V).tokens[0]) for _ in range(20)}
    assert len(runs) == 1


def test_logprobs_are_the_target_log_probabilities_of_committed_tokens():
    tree = DraftTree.chain([3, 1])
    rows = _logits_from([P_ROOT, P_NODE])
    rows[0] = rows[0] + 10.0  # logits are shift-invariant
    req = FakeReq(SamplingParams(temperature=0.0))
    out = verify_trees(rows, [req], [tree], V, return_logprob=True, top_logprobs_num=2)
    assert out.tokens == [[1, 0]]
    assert out.logprobs[0] == pytest.approx([math.log(P_ROOT[1]), math.log(P_NODE[0])], rel=1e-5)
    assert [t for _, t in out.top_logprobs[0][1]] == [0, 4]
