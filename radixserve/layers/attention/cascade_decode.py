"""Shared-prefix (cascade) decode attention for the torch-native backend.

When decoding requests share a long prefix through the radix cache, their req_to_token rows
start with the same KV slots. Gathering each request's whole KV copies that prefix once per
request per layer; here the shared prefix is gathered once per group and attended by all the
group's queries in one GEMM, each request's private suffix is attended as before, and the two
partial softmaxes are merged with their log-sum-exp statistics (exact up to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.attention.base import AttentionLayer

MIN_SHARED_PREFIX = 64  # shorter shared prefixes are not worth a separate pass


@dataclass
class CascadePlan:
    groups: list[tuple[torch.Tensor, torch.Tensor]]  # (member rows [n], prefix slots [Lp])
    suffix_index: torch.Tensor  # [B, Ls] slots of each request's private suffix (pad: 0)
    suffix_mask: torch.Tensor  # [B, 1, 1, Ls] True = attend


def shared_prefix_groups(
    kv_index: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None:
    """Groups of requests whose rows begin with the same slots: ([(member rows, prefix slots)],
    shared prefix length per request), or None when no group reaches MIN_SHARED_PREFIX."""
    if kv_index.shape[0] < 2:
        return None
    first = kv_index[:, 0]
    _, inverse, counts = torch.unique(first, return_inverse=True, return_counts=True)
    if int(counts.max()) < 2:
        return None
    shared = torch.zeros_like(seq_lens)
    groups = []
    for g in torch.nonzero(counts >= 2).flatten().tolist():
        members = torch.nonzero(inverse == g).flatten()
        # Keep at least one token (the newest) in every suffix, so no softmax part is empty.
        limit = int(seq_lens[members].min()) - 1
        rows = kv_index[members, :limit]
        same = (rows == rows[:1]).all(0)
        diff = torch.nonzero(~same)
        length = int(diff[0]) if len(diff) else limit
        if length < MIN_SHARED_PREFIX:
            continue
        groups.append((members, kv_index[members[0], :length]))
        shared[members] = length
    if not groups:
        return None
    return groups, shared


def build_cascade_plan(kv_index: torch.Tensor, seq_lens: torch.Tensor) -> CascadePlan | None:
    """Group requests whose rows begin with the same slots; None when nothing is shared."""
    found = shared_prefix_groups(kv_index, seq_lens)
    if found is None:
        return None
    groups, shared = found
    suffix_lens = seq_lens - shared
    pos = torch.arange(int(suffix_lens.max()), device=kv_index.device)
    valid = pos[None, :] < suffix_lens[:, None]
    cols = (shared[:, None] + pos[None, :]).clamp(max=kv_index.shape[1] - 1)
    suffix_index = torch.where(valid, kv_index.gather(1, cols), 0)
    return CascadePlan(groups, suffix_index, valid[:, None, None, :])


def cascade_decode(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    plan: CascadePlan,
    layer: AttentionLayer,
) -> torch.Tensor:
    """q: [B, H * D] (one query per request) → [B, H * D]."""
    bs, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
    grp = layer.num_heads // hkv
    q = q.view(bs, hkv, grp, d)
    keys = k_buf[plan.suffix_index].to(q.dtype)  # [B, Ls, Hkv, D]
    values = v_buf[plan.suffix_index].to(q.dtype)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * layer.scaling
    scores = scores.masked_fill(~plan.suffix_mask, float("-inf"))
    m, total, o = _partial_softmax(scores, values.transpose(1, 2))  # each [B, Hkv, G, *]
    for members, slots in plan.groups:
        n = len(members)
        kp = k_buf[slots].to(q.dtype).permute(1, 2, 0)  # [Hkv, D, Lp]
        vp = v_buf[slots].to(q.dtype).transpose(0, 1)  # [Hkv, Lp, D]
        qg = q[members].transpose(0, 1).reshape(hkv, n * grp, d)
        sp = torch.matmul(qg, kp).float() * layer.scaling  # [Hkv, n*G, Lp]
        mp, lp, op = _partial_softmax(sp, vp)

        def back(t: torch.Tensor, n: int = n) -> torch.Tensor:
            return t.view(hkv, n, grp, -1).transpose(0, 1)

        mp, lp, op = back(mp), back(lp), back(op)
        mm = torch.maximum(m[members], mp)
        a, b = torch.exp(m[members] - mm), torch.exp(mp - mm)
        o[members] = o[members] * a + op * b
        total[members] = total[members] * a + lp * b
        m[members] = mm
    return (o / total).to(q.dtype).reshape(bs, layer.num_heads * d)


def _partial_softmax(
    scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row max, sum of exp and unnormalised output of one part of the keys (fp32 stats)."""
    m = scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores - m)
    return m, e.sum(dim=-1, keepdim=True), torch.matmul(e.to(values.dtype), values).float()
