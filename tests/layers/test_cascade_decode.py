"""Shared-prefix (cascade) decode attention equals plain decode attention."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.attention.base import AttentionLayer
from radixserve.layers.attention.cascade_decode import build_cascade_plan, cascade_decode
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend


def _rows(prefix_groups: list[int], private: int = 0):
    """Rows whose first slots are shared within each group, followed by private slots."""
    rows, nxt = [], 5000
    for g, members in enumerate(prefix_groups):
        prefix = torch.arange(1 + g * 300, 1 + g * 300 + 200 + 30 * g)
        for m in range(members):
            tail = torch.arange(nxt, nxt + 5 + 13 * m)
            nxt += 100
            rows.append(torch.cat([prefix, tail]))
    for p in range(private):
        rows.append(torch.arange(nxt, nxt + 70 + p))
        nxt += 100
    lens = torch.tensor([len(r) for r in rows])
    kv = torch.zeros(len(rows), int(lens.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        kv[i, : len(r)] = r
    return kv, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,private", [([4], 0), ([3, 2], 2), ([2, 1, 5], 1)])
def test_cascade_matches_plain_decode(dtype, groups, private):
    torch.manual_seed(0)
    layer = AttentionLayer(0, 9, 3, 64, 64**-0.5)
    k_buf = torch.randn(9000, 3, 64).to(dtype)
    v_buf = torch.randn(9000, 3, 64).to(dtype)
    kv, lens = _rows(groups, private)
    plan = build_cascade_plan(kv, lens)
    assert plan is not None
    assert len(plan.groups) == sum(1 for g in groups if g >= 2)
    q = torch.randn(len(lens), 9 * 64).to(dtype)
    mask = (torch.arange(kv.shape[1])[None] < lens[:, None])[:, None, None, :]
    ref = TorchNativeAttnBackend._decode(q, k_buf[kv], v_buf[kv], layer, mask)
    out = cascade_decode(q, k_buf, v_buf, plan, layer)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.float(), atol=tol), (out - ref).abs().max()


def test_no_plan_without_a_long_shared_prefix():
    kv, lens = _rows([1, 1, 1], private=2)
    assert build_cascade_plan(kv, lens) is None
    short = torch.cat([torch.arange(1, 11)[None].repeat(2, 1), torch.tensor([[50], [60]])], 1)
    assert build_cascade_plan(short, torch.tensor([11, 11])) is None
