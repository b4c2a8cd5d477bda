"""csrc/lora_ops.cpp's lora_delta: every adapter's deltas of a small step in one call (each row
its own adapter's A and B), against the sum computed in float64 row by row; and the deltas of
larger steps inside the base's bf16 tiled product (csrc/bf16_linear.cpp's bf16_tiled_*_lora,
their first products by bf16_tiled_lora_shrink), against the same sums."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.cpu_kernels import cpu_kernels_available
from radixserve.layers.linear import tile_layout
from radixserve.lora.manager import kernel_weights, tiled_weights

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="radixserve's CPU kernels are not built on this machine"
)

# the accumulation is fp32 in every dtype; y is rounded once to its dtype
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def delta(y, x, a, b, slots):
    """lora_delta with each adapter's A [R, in] and B [R, out] in the kernel's layout."""
    packed = [(p, q) if p.numel() == 0 else kernel_weights(p, q) for p, q in zip(a, b, strict=True)]
    torch.ops.radixserve.lora_delta(y, x, [p for p, _ in packed], [q for _, q in packed], slots)


def reference(y, x, a, b, slots):
    want = y.double().clone()
    for r, g in enumerate(slots.tolist()):
        if g >= 0 and a[g].numel():
            want[r] += (x[r].double() @ a[g].double().t()) @ b[g].double()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,fan_in,fan_out,ranks,slots",
    [
        (1, 576, 960, [48], [0]),
        (1, 7, 3, [1], [0]),
        (9, 100, 130, [8, 0, 5], [0, 2, -1, 1, 2, 0, 2, 2, 2]),  # a group with no weights here
        (32, 576, 3072, [32, 16, 16, 4], [i % 4 for i in range(32)]),
        (32, 1536, 576, [16], [0] * 32),  # blocks of four rows of one adapter
        (13, 64, 200, [12, 3], [1, 1, 1, 1, 1, 0, 0, -1, 0, 0, 0, 0, 1]),
        (6, 48, 64, [16, 16], [-1] * 6),  # no row uses an adapter
    ],
)
def test_lora_delta_adds_each_rows_adapter(dtype, n, fan_in, fan_out, ranks, slots):
    g = torch.Generator().manual_seed(n * 7 + fan_in)
    x = torch.randn(n, fan_in, generator=g).to(dtype)
    # y: a view with a row stride larger than its width (as a fused output's slice would be)
    base = torch.randn(n, fan_out + 5, generator=g).to(dtype)
    y = base[:, :fan_out]
    a = [
        (torch.randn(r, fan_in, generator=g) * 0.1).to(dtype) if r else torch.empty(0)
        for r in ranks
    ]
    b = [
        (torch.randn(r, fan_out, generator=g) * 0.1).to(dtype) if r else torch.empty(0)
        for r in ranks
    ]
    slot_t = torch.tensor(slots, dtype=torch.int64)
    before = base.clone()
    want = reference(y, x, a, b, slot_t)
    delta(y, x, a, b, slot_t)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)
    assert torch.equal(base[:, fan_out:], before[:, fan_out:])  # nothing beyond y's columns
    for r, s in enumerate(slots):
        if s < 0 or ranks[s] == 0:
            assert torch.equal(y[r], before[r, :fan_out])  # rows without a delta untouched


def test_lora_delta_is_the_same_bits_whatever_else_is_in_the_step():
    """A row's delta does not depend on the other rows or adapters of the call (what the
    scheduler batches with a request must not change its output)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 96, generator=g).bfloat16()
    a = [torch.randn(r, 96, generator=g).bfloat16() for r in (8, 16, 4)]
    b = [torch.randn(r, 80, generator=g).bfloat16() for r in (8, 16, 4)]
    y0 = torch.randn(12, 80, generator=g).bfloat16()
    mixed = torch.tensor([0, 1, 2, 1, 0, -1, 1, 1, 1, 2, 0, 1])
    y = y0.clone()
    delta(y, x, a, b, mixed)
    for r in range(12):
        if mixed[r] < 0:
            continue
        alone = y0[r : r + 1].clone()
        delta(alone, x[r : r + 1], a, b, torch.tensor([int(mixed[r])]))
        assert torch.equal(alone[0], y[r]), r


def test_lora_delta_refuses_bad_arguments():
    x, y = torch.randn(2, 8), torch.randn(2, 6)
    a, b = kernel_weights(torch.randn(4, 8), torch.randn(4, 6))
    a, b = [a], [b]
    op = torch.ops.radixserve.lora_delta
    with pytest.raises(RuntimeError, match="slot out of range"):
        op(y, x, a, b, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="slots \\[n\\] int64"):
        op(y, x, a, b, torch.tensor([0, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="a\\[g\\] \\[R, in\\]"):
        op(y, x, [torch.randn(4, 7)], b, torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="a\\[g\\] \\[R, in\\]"):
        op(y, x, a, [torch.randn(4, 6)], torch.tensor([0, 0]))  # B not in tiles
    with pytest.raises(RuntimeError, match="in x's dtype"):
        op(y, x, [a[0].double()], b, torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="one dtype"):
        op(y.double(), x, a, b, torch.tensor([0, 0]))
    if torch.ops.radixserve.lora_delta_pairs():  # bf16 takes ranks in pairs
        a16, b16 = (torch.randn(3, 8).bfloat16(),), (torch.randn(3, 64).bfloat16().view(1, 3, 64),)
        with pytest.raises(RuntimeError, match="pairs of ranks"):
            op(y.bfloat16(), x.bfloat16(), list(a16), list(b16), torch.tensor([0, 0]))


# -- the deltas inside the bf16 tiled product -----------------------------------------------------
def _tiles_built() -> bool:
    return bool(torch.ops.radixserve.bf16_tiled_supported())


def _tiled(x, w, bias, a, b, slots, silu):
    """bf16_tiled_lora_shrink then bf16_tiled_(linear|silu_mul)_lora, as LoRALinear calls them."""
    ops = torch.ops.radixserve
    packed = [(p, q) if p.numel() == 0 else tiled_weights(p, q) for p, q in zip(a, b, strict=True)]
    xa = ops.bf16_tiled_lora_shrink(x, [p for p, _ in packed], slots)
    bt = [q for _, q in packed]
    if silu:
        return xa, ops.bf16_tiled_silu_mul_lora(x, tile_layout(w), xa, slots, bt)
    return xa, ops.bf16_tiled_linear_lora(x, tile_layout(w), bias, xa, slots, bt)


@pytest.mark.skipif(not cpu_kernels_available() or not _tiles_built(), reason="no bf16 tiles")
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(
    "n,fan_in,fan_out,ranks,order",
    [
        (1, 576, 960, [48], "random"),
        (200, 576, 960, [48, 16, 0, 64], "runs"),  # SmolLM2's qkv; ranks 48 and 64 span tiles
        (257, 576, 3072, [16, 8], "runs"),  # a row past the 256-row blocks
        (130, 1536, 576, [16, 16, 4], "random"),  # every 32 rows mixed: copied per adapter
        (33, 64, 128, [4, 8, 2], "random"),
        (70, 48, 64, [16, 8], "random"),  # K not a multiple of 32: vdpbf16ps even with AMX
        (40, 80, 96, [40], "runs"),
    ],
)
def test_tiled_product_adds_each_rows_adapter(silu, n, fan_in, fan_out, ranks, order):
    if silu and fan_out % 32:
        pytest.skip("silu_mul takes whole tiles of gate and of up")
    g = torch.Generator().manual_seed(n + fan_in)
    x = torch.randn(n, fan_in, generator=g).bfloat16()
    w = (torch.randn(fan_out, fan_in, generator=g) * 0.05).bfloat16()
    bias = None if silu else (torch.randn(fan_out, generator=g) * 0.1).bfloat16()
    a = [
        (torch.randn(r, fan_in, generator=g) * 0.05).bfloat16() if r else torch.empty(0)
        for r in ranks
    ]
    b = [
        (torch.randn(r, fan_out, generator=g) * 0.05).bfloat16() if r else torch.empty(0)
        for r in ranks
    ]
    slots = torch.randint(-1, len(ranks), (n,), generator=g)
    if order == "runs":  # a prefill's: each request's rows together
        slots = slots.sort().values
    xa, y = _tiled(x, w, bias, a, b, slots, silu)
    # the first products: each row's x Aᵀ rounded to bf16, zeros elsewhere
    want_xa = torch.zeros(n, xa.shape[1], dtype=torch.float64)
    for r, s in enumerate(slots.tolist()):
        if s >= 0 and ranks[s]:
            want_xa[r, : ranks[s]] = x[r].double() @ a[s].double().t()
    torch.testing.assert_close(xa.double(), want_xa, rtol=1e-2, atol=1e-2)
    # the product plus, from those first products, each row's B
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    for r, s in enumerate(slots.tolist()):
        if s >= 0 and ranks[s]:
            want[r] += xa[r, : ranks[s]].double() @ b[s].double()
    if silu:
        half = fan_out // 2
        want = torch.nn.functional.silu(want[:, :half]) * want[:, half:]
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
    # a row without an adapter is the plain product's, bitwise; each row's result is the same
    # bits whatever the other rows' adapters are (its step's company never changes it)
    ops = torch.ops.radixserve
    plain = (
        ops.bf16_tiled_silu_mul(x, tile_layout(w))
        if silu
        else ops.bf16_tiled_linear(x, tile_layout(w), bias)
    )
    free = slots < 0
    assert torch.equal(y[free], plain[free])
    for r in torch.randperm(n, generator=g)[:4].tolist():
        alone = _tiled(x[r : r + 1], w, bias, a, b, slots[r : r + 1], silu)[1]
        assert torch.equal(alone[0], y[r]), r


@pytest.mark.skipif(not cpu_kernels_available() or not _tiles_built(), reason="no bf16 tiles")
def test_tiled_lora_ops_refuse_bad_arguments():
    ops = torch.ops.radixserve
    x, w = torch.randn(3, 64).bfloat16(), tile_layout(torch.randn(32, 64).bfloat16())
    at, bt = tiled_weights(torch.randn(4, 64).bfloat16(), torch.randn(4, 32).bfloat16())
    slots = torch.tensor([0, -1, 0])
    xa = ops.bf16_tiled_lora_shrink(x, [at], slots)
    assert xa.shape == (3, 32)
    with pytest.raises(RuntimeError, match="slot 1 of row 0 is not -1 or one of the 1 groups"):
        ops.bf16_tiled_lora_shrink(x, [at], torch.tensor([1, 0, 0]))
    with pytest.raises(RuntimeError, match="slots must be \\[M\\] int64"):
        ops.bf16_tiled_linear_lora(x, w, None, xa, slots.int(), [bt])
    with pytest.raises(RuntimeError, match="A has 32 columns, x 64"):
        ops.bf16_tiled_lora_shrink(x, [at[:, :16].contiguous()], slots)
    with pytest.raises(RuntimeError, match="B must be \\[N/16, R/2, 32\\]"):
        ops.bf16_tiled_linear_lora(x, w, None, xa, slots, [bt[:1].contiguous()])
    with pytest.raises(RuntimeError, match="rank 64 exceeds xa's 32 columns"):
        ops.bf16_tiled_linear_lora(x, w, None, xa, slots, [torch.cat([bt, bt], 1)])
    with pytest.raises(RuntimeError, match="xa must be contiguous \\[M, R\\] bf16"):
        ops.bf16_tiled_linear_lora(x, w, None, xa.float(), slots, [bt])
