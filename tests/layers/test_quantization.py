"""Weight-only int8 / int4 linear layers (`--quantization`) against fp32 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import quantization
from radixserve.layers.quantization import (
    DENSE_ROWS,
    DENSE_ROWS_BF16,
    INT4_GROUP_SIZE,
    KERNEL_DTYPE,
    BlockParams,
    QuantizedLinear,
    dequantize_int4,
    pack_q4,
    quantize_activations,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantize_q8,
)


def _bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 activations and scales: ~3 significant digits, relative to the output's scale.
    scale = expected.abs().max().item()
    assert (actual.float() - expected).abs().max().item() <= 2e-2 * scale


_tiled_supported = quantization.tiled_supported  # the real one: fixtures patch the module's

needs_tiled = pytest.mark.skipif(
    not _tiled_supported(), reason="the tiled kernels are built for CPUs with AVX-512 VNNI only"
)


@pytest.fixture
def untiled(monkeypatch):
    """int4 and int8 layers as on a CPU without AVX-512 VNNI: q4_linear / q8_linear, then
    q4_dense / q8_dense."""
    monkeypatch.setattr(quantization, "tiled_supported", lambda: False)


@pytest.fixture(params=["q8_tiled", "q8", "aten"])
def int8_kernel(request, monkeypatch):
    """Every int8 path: the tiled kernel (AVX-512 VNNI), radixserve's q8 kernels elsewhere, and
    ATen's where the C++ kernels cannot build."""
    if request.param == "q8_tiled" and not _tiled_supported():
        pytest.skip("q8_tiled_linear is built for CPUs with AVX-512 VNNI only")
    if request.param == "q8":
        monkeypatch.setattr(quantization, "tiled_supported", lambda: False)
    if request.param == "aten":
        monkeypatch.setattr(quantization, "cpu_kernels_available", lambda: False)
    return request.param


@pytest.mark.parametrize("shape", [(48, 64), (960, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 7, 33, DENSE_ROWS])  # GEMV, then GEMM (q8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_its_dequantized_weight(shape, rows, dtype, int8_kernel) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=gen) * 0.05
    bias = torch.randn(shape[0], generator=gen)
    layer = QuantizedLinear("int8", w, bias).to(dtype)  # the bias follows the model dtype
    assert layer.kernel == int8_kernel
    if int8_kernel != "aten":  # Q8_0: a scale per group of 32 columns
        codes, scale = quantize_q8(w)
        step = scale.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    else:  # a scale per output channel
        codes, scale = quantize_int8(w)
        step = scale[:, None].expand_as(w)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    deq = codes.float() * step
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()  # within half a step of the weight
    x = torch.randn(rows, shape[1], generator=gen)
    ref = x @ deq.t() + bias
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, shape[0])
    _bf16_close(out, ref)  # bf16 activations (ATen), int8 ones (q8_tiled) or fp32 ones (q8)
    if int8_kernel == "q8" and dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if int8_kernel == "q8_tiled" and dtype == torch.float32:  # activations on the int8 grid
        torch.testing.assert_close(out, quantize_activations(x) @ deq.t() + bias, rtol=0, atol=1e-5)


@pytest.mark.parametrize("k", [8, 100, 120, 576])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_int8_layers_of_any_width_on_atens_kernel(k, rows) -> None:
    """Widths that are not a multiple of 32 take ATen's int8 kernel (as every layer does where
    the C++ kernels cannot build); it read K in steps of 16, so K = 100 or 120 gave garbage or a
    SIGSEGV until the layer padded K."""
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(64, k, generator=gen) * 0.05
    layer = QuantizedLinear("int8", w)
    if k % INT4_GROUP_SIZE:
        assert layer.kernel == "aten"
    codes, scale = quantize_int8(w)
    x = torch.randn(rows, k, generator=gen)
    _bf16_close(layer(x), x @ (codes.float() * scale[:, None]).t())


@pytest.fixture(params=["q4_tiled", "q4", "aten"])
def int4_kernel(request, monkeypatch):
    """Every int4 path: the tiled kernel (AVX-512 VNNI), radixserve's q4 kernels elsewhere, and
    ATen's where the C++ kernels cannot build."""
    if request.param == "q4_tiled" and not _tiled_supported():
        pytest.skip("q4_tiled_linear is built for CPUs with AVX-512 VNNI only")
    if request.param == "q4":
        monkeypatch.setattr(quantization, "tiled_supported", lambda: False)
    if request.param == "aten":
        monkeypatch.setattr(quantization, "cpu_kernels_available", lambda: False)
    return request.param


@pytest.mark.parametrize("shape", [(16, 32), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, DENSE_ROWS - 1, DENSE_ROWS])  # GEMV, then GEMM
def test_int4_linear_matches_its_dequantized_weight(shape, rows, int4_kernel) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=gen) * 0.05
    layer = QuantizedLinear("int4", w)
    assert layer.kernel == int4_kernel
    codes, scale, minimum = quantize_int4(w)
    assert int(codes.min()) == 0 and int(codes.max()) == 15
    deq = dequantize_int4(codes, scale, minimum)
    # Min/max groups: every weight within half a step of its group.
    step = scale.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(2, rows, shape[1], generator=gen)  # leading dims are kept
    out = layer(x)
    assert out.shape == (2, rows, shape[0]) and out.dtype == torch.float32
    _bf16_close(out, x @ deq.t())


def test_int4_blocks_keep_the_files_codes_where_min_max_would_not() -> None:
    """Rows with GGUF block parameters keep their codes even when a group does not span
    0..15 (min/max would then pick a finer grid and round the values differently)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 32, 64
    groups = k // INT4_GROUP_SIZE
    codes = torch.randint(3, 13, (n, k), generator=gen, dtype=torch.int32)  # never 0 or 15
    # fp16 values, as a GGUF block holds them
    scale = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).half().float()
    minimum = (-torch.rand(n, groups, generator=gen) * 0.05).half().float()
    w = dequantize_int4(codes, scale, minimum)
    blocks = [BlockParams(8, scale[8:24], minimum[8:24])]
    got, got_scale, got_min = quantize_int4(w, blocks)
    assert torch.equal(got[8:24], codes[8:24])
    assert torch.equal(got_scale[8:24], scale[8:24]) and torch.equal(got_min[8:24], minimum[8:24])
    assert torch.equal(dequantize_int4(got, got_scale, got_min)[8:24], w[8:24])
    free, _, _ = quantize_int4(w)  # no blocks: the rows are requantized onto a new grid
    assert not torch.equal(free[8:24], codes[8:24])


def test_int4_zero_scale_groups_and_bad_shapes(int4_kernel) -> None:
    w = torch.zeros(16, 64)
    w[:, 32:] = 0.5  # constant groups: scale 0
    layer = QuantizedLinear("int4", w)
    x = torch.ones(1, 64)
    _bf16_close(layer(x), x @ w.t())
    with pytest.raises(ValueError, match="out_features % 16"):
        QuantizedLinear("int4", torch.randn(8, 64))
    with pytest.raises(ValueError, match="unknown quantization"):
        QuantizedLinear("int3", torch.randn(16, 64))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 48)  # 48 rows: int4 packs it
        self.b = nn.Linear(48, 40, bias=False)  # 48 columns: not whole groups of 32 -> int8
        self.embed = nn.Embedding(32, 64)
        self.lm_head = None

    def quantize_tied_head(self, quantize):
        self.lm_head = quantize(self.embed.weight)
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.b(self.a(x)).sum(-1, keepdim=True).expand(-1, 64))


def test_quantize_model_replaces_every_linear_and_survives_dtype_casts() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    quantize_model(model, "int4")
    assert isinstance(model.a, QuantizedLinear) and model.a.method == "int4"
    assert isinstance(model.b, QuantizedLinear) and model.b.method == "int8"
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.method == "int8"
    assert isinstance(model.embed, nn.Embedding)  # the lookup stays dense
    # radixserve's kernels (built for the test session): tiled int4 where the CPU has VNNI
    assert model.a.kernel == ("q4_tiled" if _tiled_supported() else "q4")
    assert model.lm_head.kernel == ("q8_tiled" if _tiled_supported() else "q8")
    assert model.b.kernel == "aten"  # 48 columns: per channel
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        if _tiled_supported():  # codes, scales and minimums in one uint8 buffer
            assert model.a.tiles.dtype == model.lm_head.tiles.dtype == torch.uint8
        else:
            assert model.a.d.dtype == torch.float32 and model.a.qs.dtype == torch.uint8
        assert model.b.scales.dtype == KERNEL_DTYPE and model.b.packed.dtype == torch.int8
        assert model.a.bias.dtype == dtype
        out = model(torch.randn(3, 64, dtype=dtype))
        assert out.dtype == dtype and out.shape == (3, 32) and torch.isfinite(out).all()


def test_q4_kernels_against_the_reference() -> None:
    """q4_dequantize reproduces dequantize_int4; q4_linear's int8 activations stay within
    1.5% of the output's scale, and each row's result does not depend on the other rows."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen) * 0.05
    codes, scale, minimum = quantize_int4(w)
    qs = pack_q4(codes)
    assert qs.shape == (96, 4, 16) and qs.dtype == torch.uint8
    deq = torch.ops.radixserve.q4_dequantize(qs, scale, minimum)
    assert torch.allclose(deq, dequantize_int4(codes, scale, minimum), atol=1e-6)
    x = torch.randn(7, 128, generator=gen)
    y = torch.ops.radixserve.q4_linear(x, qs, scale, minimum)
    ref = x @ deq.t()
    assert (y - ref).abs().max() <= 0.015 * ref.abs().max()
    alone = torch.ops.radixserve.q4_linear(x[3:4], qs, scale, minimum)
    assert torch.equal(alone[0], y[3])
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.radixserve.q4_linear(torch.randn(1, 96), qs, scale, minimum)


@pytest.mark.parametrize("outputs", [99, 96])
def test_q4_rows_do_not_depend_on_the_batch(outputs) -> None:
    """The kernel computes blocks of rows by outputs (4 x 2, 1 x 4, 1 x 2, 1 x 1 at the
    tails); each row of every batch size equals that row computed alone, bitwise, so a
    request's tokens do not depend on what else is in its decode batch."""
    gen = torch.Generator().manual_seed(6)
    codes, scale, minimum = quantize_int4(torch.randn(outputs, 96, generator=gen) * 0.05)
    qs = pack_q4(codes)
    x = torch.randn(11, 96, generator=gen)
    alone = torch.cat(
        [torch.ops.radixserve.q4_linear(x[i : i + 1], qs, scale, minimum) for i in range(11)]
    )
    for rows in range(1, 12):
        batch = torch.ops.radixserve.q4_linear(x[:rows], qs, scale, minimum)
        assert torch.equal(batch, alone[:rows]), rows


def _tile_part(tiles: torch.Tensor, i: int, g: int, part: int, sizes: list[int]) -> torch.Tensor:
    """Bytes of part `part` (0: the codes; 1: the scales, int4's followed by its minimums;
    sizes[part] bytes each) of tile i's group g in the tiled kernels' storage: pair j of the
    F = T // 2 pairs holds tiles j and F + j, group after group, each part of both tiles in
    turn, their 64-byte vectors alternating; an odd last tile follows alone."""
    t, groups, _ = tiles.shape
    f = t // 2
    block, slot, count = (i, 0, 2) if i < f else (i - f, 1, 2) if i < 2 * f else (f, 0, 1)
    at = block * 2 * groups * sum(sizes) + g * count * sum(sizes) + count * sum(sizes[:part])
    flat = tiles.reshape(-1)
    starts = [at + (v * count + slot) * 64 for v in range(sizes[part] // 64)]
    return torch.cat([flat[s : s + 64] for s in starts])


def _code_lanes(tiles: torch.Tensor, sizes: list[int], picks: tuple[tuple[int, int], ...]):
    """(i, g, q, t, lane): lane t of code vector q of tile i's group g, for every tile and
    group and each (q, t) in picks; its 4 bytes."""
    for i in range(tiles.shape[0]):
        for g in range(tiles.shape[1]):
            packed = _tile_part(tiles, i, g, 0, sizes)
            for q, t in picks:
                yield i, g, q, t, packed[q * 64 + t * 4 : q * 64 + t * 4 + 4]


@pytest.mark.parametrize("n", [48, 64])  # 3 tiles (a pair and a lone one), 4 (two pairs)
def test_q4_tiles_hold_the_kernels_bytes_reordered(n) -> None:
    """pack_q4_tiles: tile i, group g, vector q, lane t holds bytes 4q .. 4q + 3 of output
    16i + t's group g (so its codes 4q .. 4q + 3 in the low nibbles, 16 + 4q .. in the high);
    then the scales and the minimums of the tile's 16 outputs in fp16; stored pair by pair."""
    gen = torch.Generator().manual_seed(11)
    codes, scale, minimum = quantize_int4(torch.randn(n, 96, generator=gen) * 0.05)
    qs = pack_q4(codes)
    tiles = quantization.pack_q4_tiles(qs, scale, minimum)
    assert tiles.shape == (n // 16, 3, 320) and tiles.dtype == torch.uint8
    sizes = [256, 64]
    for i, g, q, t, lane in _code_lanes(tiles, sizes, ((0, 0), (3, 15), (2, 7), (1, 4))):
        assert torch.equal(lane, qs[16 * i + t, g, 4 * q : 4 * q + 4])
        low, high = lane & 0x0F, lane >> 4
        k = 32 * g + 4 * q
        assert torch.equal(low.int(), codes[16 * i + t, k : k + 4])
        assert torch.equal(high.int(), codes[16 * i + t, k + 16 : k + 20])
    for i in range(n // 16):
        for g in range(3):
            d, m = _tile_part(tiles, i, g, 1, sizes).view(torch.float16).float().split(16)
            assert torch.equal(d, scale[16 * i : 16 * i + 16, g])
            assert torch.equal(m, minimum[16 * i : 16 * i + 16, g])
    with pytest.raises(ValueError, match="fp16 values"):  # not what quantize_int4 made
        quantization.pack_q4_tiles(qs, scale * (1 + 1e-6), minimum)


def test_int4_scales_and_minimums_are_fp16_values() -> None:
    """quantize_int4 holds each group's scale and minimum at fp16 precision (GGUF Q4_1's, and
    the tiled kernels' storage) and picks the codes for those values: dequantized, every
    weight is within half a step (plus fp16's rounding of the group's ends) of the original; a GGUF
    block's own fp16 values pass unchanged; weights beyond fp16's range are refused."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(32, 128, generator=gen) * 0.05
    codes, scale, minimum = quantize_int4(w)
    assert torch.equal(scale.half().float(), scale) and torch.equal(minimum.half().float(), minimum)
    err = (dequantize_int4(codes, scale, minimum) - w).view(32, 4, 32).abs().amax(-1)
    assert (err <= scale * 0.5 + (minimum.abs() + 15 * scale) * 2**-10 + 1e-7).all()
    d = (torch.rand(32, 4, generator=gen) * 0.01).half().float()
    block = quantization.BlockParams(row_offset=0, scale=d, minimum=-8 * d)
    codes, scale, minimum = quantize_int4(w, [block])
    assert torch.equal(scale, d) and torch.equal(minimum, -8 * d)
    with pytest.raises(ValueError, match="fp16's range"):
        quantize_int4(w * 1e6)
    model = nn.Sequential(nn.Linear(128, 32), nn.Linear(128, 32))
    with torch.no_grad():
        model[1].weight.mul_(1e6)
    quantize_model(model, "int4")  # the layer int4 cannot hold stays int8, the other int4
    assert model[0].method == "int4" and model[1].method == "int8"


@pytest.mark.parametrize("n", [48, 64])
def test_q8_tiles_hold_the_codes_offset_and_reordered(n) -> None:
    """pack_q8_tiles: tile i, group g, vector q, lane t holds codes 4q .. 4q + 3 of output
    16i + t's group g, each plus 128 (unsigned, for vpdpbusd); then the scales of the tile's
    16 outputs (fp32); stored pair by pair."""
    gen = torch.Generator().manual_seed(12)
    codes, scale = quantize_q8(torch.randn(n, 96, generator=gen) * 0.05)
    codes[5, 40] = -127  # both ends of the range
    tiles = quantization.pack_q8_tiles(codes, scale)
    assert tiles.shape == (n // 16, 3, 576) and tiles.dtype == torch.uint8
    sizes = [512, 64]
    for i, g, q, t, lane in _code_lanes(tiles, sizes, ((0, 0), (7, 15), (4, 7), (2, 5))):
        k = 32 * g + 4 * q
        assert torch.equal(lane.int() - 128, codes[16 * i + t, k : k + 4].int())
    for i in range(n // 16):
        for g in range(3):
            d = _tile_part(tiles, i, g, 1, sizes).view(torch.float32)
            assert torch.equal(d, scale[16 * i : 16 * i + 16, g])
            assert _tile_part(tiles, i, g, 0, sizes).min() >= 1


def _tiled(method: str, n: int, k: int, gen: torch.Generator):
    """A random tiled weight: the op, its tensors, the dequantized weight (float64), and the
    untiled kernel computing the same function (int4: q4_linear), or None (int8: q8_linear
    keeps float activations)."""
    ops = torch.ops.radixserve
    if method == "int4":
        codes, scale, minimum = quantize_int4(torch.randn(n, k, generator=gen) * 0.05)
        qs = pack_q4(codes)
        tiles = (quantization.pack_q4_tiles(qs, scale, minimum),)
        w = ops.q4_dequantize(qs, scale, minimum)
        return (
            ops.q4_tiled_linear,
            tiles,
            w.double(),
            lambda x: ops.q4_linear(x, qs, scale, minimum),
        )
    codes, scale = quantize_q8(torch.randn(n, k, generator=gen) * 0.05)
    tiles = (quantization.pack_q8_tiles(codes, scale),)
    return ops.q8_tiled_linear, tiles, ops.q8_dequantize(codes, scale).double(), None


@needs_tiled
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(16, 32), (96, 128), (1104, 576), (64, 4096)])
def test_tiled_against_the_reference(method, n, k) -> None:
    """q4_tiled_linear and q8_tiled_linear: the weight times the activations on q4_linear's
    int8 grid, each group's products summed exactly in integers and the groups in fp32, so
    within fp32 rounding of the float64 product (and for int4 of q4_linear's rows, the same
    function in another order); every row count from 1 to 19 (8-row passes and each tail),
    zero rows and groups, bf16 and non-contiguous inputs."""
    gen = torch.Generator().manual_seed(n + k)
    op, tiles, w, same = _tiled(method, n, k, gen)
    x = torch.randn(19, k, generator=gen) * 2
    x[3] = 0  # a zero row: scale 0, codes 0
    x[5, :32] = 0  # and a zero group
    x[6, 32:64] = -x[6, 32:64].abs()  # a group of negative codes only (int8's offset: -128 each)
    ref = quantize_activations(x).double() @ w.t()
    bound = 1e-6 * ref.abs().max().item() * (k // 32) ** 0.5
    for rows in range(1, 20):
        got = op(x[:rows], *tiles)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert (got.double() - ref[:rows]).abs().max().item() <= bound, rows
    assert torch.equal(got[3], torch.zeros(n))
    if same is not None:
        torch.testing.assert_close(got, same(x), rtol=0, atol=4 * bound)
    # a coarser grid would show: the same product with the activations rounded to 6 bits
    amax = x.abs().amax(1, keepdim=True).clamp_min(1e-9)
    coarse = (x / amax * 31).round() * amax / 31
    assert ((coarse.double() @ w.t()) - ref).abs().max().item() > 100 * bound
    # bf16 in, bf16 out: the fp32 result of the same (widened) input, rounded
    half = op(x.bfloat16(), *tiles)
    widened = op(x.bfloat16().float(), *tiles)
    assert half.dtype == torch.bfloat16 and torch.equal(half, widened.bfloat16())
    wide = torch.randn(19, 2 * k, generator=gen)
    wide[:, ::2] = x
    assert torch.equal(op(wide[:, ::2], *tiles), got)


@needs_tiled
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_tiled_rows_do_not_depend_on_the_batch(method) -> None:
    """Each row of every batch size equals that row alone, bitwise (the 8-row passes, the
    tails and the 256-row blocks run the same operations per row), so a request's tokens do
    not depend on how many others share its step; an empty batch and bad shapes are clear."""
    gen = torch.Generator().manual_seed(7)
    op, tiles, _, _ = _tiled(method, 48, 160, gen)
    x = torch.randn(21, 160, generator=gen)
    alone = torch.cat([op(x[i : i + 1], *tiles) for i in range(21)])
    for rows in range(1, 22):
        assert torch.equal(op(x[:rows], *tiles), alone[:rows]), rows
    many = torch.randn(600, 160, generator=gen).bfloat16()  # a prefill: blocks of 256 rows
    got = op(many, *tiles)
    for i in (0, 7, 255, 256, 263, 511, 512, 599):
        assert torch.equal(got[i], op(many[i : i + 1], *tiles)[0]), i
    assert op(x[:0], *tiles).shape == (0, 48)
    (wt,) = tiles
    with pytest.raises(RuntimeError, match="columns"):
        op(x[:, :128], wt)
    with pytest.raises(RuntimeError, match="wt must be"):
        op(x, wt[..., :128].contiguous())
    with pytest.raises(RuntimeError, match="wt must be"):
        op(x, wt.transpose(0, 1))
    with pytest.raises(RuntimeError, match="wt must be"):  # the other method's tiles
        op(x, torch.zeros(3, 5, 320 if method == "int8" else 576, dtype=torch.uint8))


@needs_tiled
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("n,k", [(3072, 576), (64, 32), (96, 160)])  # 96: 3 gate tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_silu_mul_is_the_product_then_silu_and_mul(method, n, k, dtype) -> None:
    """The fused MLP kernel (a [gate; up] weight in tiles, SiLU and product applied as each
    gate tile and its up tile finish) gives silu_and_mul(product) bitwise, with the same
    roundings to bf16 in between: at every row count of the passes and tails (1-19), across
    256-row blocks, for gate widths that share out unevenly between the threads."""
    gen = torch.Generator().manual_seed(11)
    op, tiles, _, _ = _tiled(method, n, k, gen)
    fused = getattr(torch.ops.radixserve, f"q{4 if method == 'int4' else 8}_tiled_silu_mul")
    for rows in [*range(1, 20), 600]:
        x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
        want = torch.ops.radixserve.silu_and_mul(op(x, *tiles))
        got = fused(x, *tiles)
        assert got.dtype == dtype and got.shape == (rows, n // 2)
        assert torch.equal(got, want), rows
    assert fused(x[:0], *tiles).shape == (0, n // 2)
    with pytest.raises(RuntimeError, match="whole tiles"):  # 3 tiles: no [gate; up] split
        fused(x, *(t[:3].contiguous() for t in tiles))
    with pytest.raises(RuntimeError, match="columns"):
        fused(x[:, :-32], *tiles)


def test_quantized_silu_and_mul_only_where_the_fused_kernel_applies() -> None:
    """QuantizedLinear.silu_and_mul: the fused kernel's result for a tiled bias-free layer in
    bf16 or fp32 (equal to the layer then silu_and_mul), None for everything it cannot do."""
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(128, 64, generator=gen) * 0.05
    x = torch.randn(3, 5, 64, generator=gen)
    for method in ("int4", "int8"):
        layer = QuantizedLinear(method, w)
        if layer.kernel.endswith("_tiled"):
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                want = torch.ops.radixserve.silu_and_mul(layer(xd).reshape(15, 128))
                assert torch.equal(layer.silu_and_mul(xd), want.reshape(3, 5, 64))
        assert layer.silu_and_mul(x.half()) is None
        assert QuantizedLinear(method, w, bias=torch.ones(128)).silu_and_mul(x) is None
    assert QuantizedLinear("int8", w[:48]).silu_and_mul(x) is None  # 48 = 3 tiles
    assert QuantizedLinear("w8a8_int8", w).silu_and_mul(x) is None


def test_q4_gemv_and_gemm_paths_agree_row_by_row(untiled) -> None:
    """A prompt's rows go through the GEMM at prefill and the kernel at decode (or after a
    cache hit): both see the same int8 activations, so they agree far inside the
    quantization error, and the same prompt gives the same tokens either way."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(576, 576, generator=gen) * 0.05
    layer = QuantizedLinear("int4", w)
    x = torch.randn(DENSE_ROWS, 576, generator=gen)
    gemm = layer(x)  # 64 rows: the dequantized GEMM
    gemv = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])  # one row each: the kernel
    assert (gemm - gemv).abs().max() <= 1e-5 * gemm.abs().max()


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("native_bf16", [True, False])
def test_bf16_prefill_gemm_agrees_with_the_kernel_rows(
    method, native_bf16, untiled, monkeypatch
) -> None:
    """A bf16 model's prefill-sized products: in bf16 on a CPU with native bf16 matmuls, in
    fp32 elsewhere. Either way each row agrees with the kernel's own row (the decode path)
    to bf16's tolerance, and the output keeps the model's dtype."""
    monkeypatch.setattr(quantization, "cpu_has_bf16", lambda: native_bf16)
    gen = torch.Generator().manual_seed(8)
    layer = QuantizedLinear(method, torch.randn(320, 576, generator=gen) * 0.05)
    x = torch.randn(DENSE_ROWS + 5, 576, generator=gen).to(torch.bfloat16)
    gemm = layer(x)
    assert gemm.dtype == torch.bfloat16
    rows = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    err = (gemm.float() - rows.float()).abs().max() / rows.float().abs().max()
    assert err <= 2e-2, err
    if method == "int4":  # the GEMM ran in the dtype the capability picks
        w = torch.ops.radixserve.q4_dequantize(layer.qs, layer.d, layer.m)
        xq = quantize_activations(x)
        want = F.linear(xq.bfloat16(), w.bfloat16()) if native_bf16 else F.linear(xq, w)
        assert torch.equal(gemm, want.to(torch.bfloat16))


def test_q8_kernels_against_the_reference(untiled) -> None:
    """q8_dequantize is codes * scale; q8_linear equals the dequantized weight's product up to
    float order (the activations stay fp32); each row's result does not depend on the other
    rows; the kernel's GEMV and the dequantized GEMM agree row by row; bad shapes are clear
    errors."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(96, 128, generator=gen) * 0.05
    codes, scale = quantize_q8(w)
    assert codes.shape == (96, 128) and scale.shape == (96, 4)
    deq = torch.ops.radixserve.q8_dequantize(codes, scale)
    assert torch.equal(deq, codes.float() * scale.repeat_interleave(INT4_GROUP_SIZE, dim=1))
    x = torch.randn(7, 128, generator=gen) * 3
    y = torch.ops.radixserve.q8_linear(x, codes, scale)
    ref = x @ deq.t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.ops.radixserve.q8_linear(x[3:4], codes, scale)[0], y[3])
    layer = QuantizedLinear("int8", w)
    rows = torch.randn(DENSE_ROWS, 128, generator=gen)
    gemm = layer(rows)
    gemv = torch.cat([layer(rows[i : i + 1]) for i in range(len(rows))])
    assert (gemm - gemv).abs().max() <= 1e-5 * gemm.abs().max()
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.radixserve.q8_linear(torch.randn(1, 96), codes, scale)
    with pytest.raises(RuntimeError, match=r"d must be"):
        torch.ops.radixserve.q8_linear(x, codes, scale[:, :3].contiguous())


@pytest.mark.parametrize("n", [40, 1100])  # one block of dequantized weight; three (fp32)
@pytest.mark.parametrize("bf16", [False, True])
def test_dense_paths_against_the_reference(n, bf16) -> None:
    """q4_dense and q8_dense: the activations (rounded to the int8 grid for q4) times the
    dequantized weight, in bf16 or fp32, dequantized block by block: bitwise the reference
    product for one block, within float order across blocks; bad shapes are clear errors."""
    gen = torch.Generator().manual_seed(9)
    k = 1024  # fp32 blocks of 512 rows: 1,100 rows are two whole blocks and a part
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(20, k, generator=gen)
    dtype = torch.bfloat16 if bf16 else torch.float32
    codes, scale, minimum = quantize_int4(w)
    qs = pack_q4(codes)
    w4 = torch.ops.radixserve.q4_dequantize(qs, scale, minimum)
    got4 = torch.ops.radixserve.q4_dense(x, qs, scale, minimum, bf16)
    want4 = F.linear(quantize_activations(x).to(dtype), w4.to(dtype))
    q8, d8 = quantize_q8(w)
    w8 = torch.ops.radixserve.q8_dequantize(q8, d8)
    got8 = torch.ops.radixserve.q8_dense(x, q8, d8, bf16)
    want8 = F.linear(x.to(dtype), w8.to(dtype))
    for got, want in ((got4, want4), (got8, want8)):
        assert got.dtype == dtype and got.shape == (20, n)
        if n == 40:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the rows of the kernel and of the dense path: one function up to float order (fp32)
    if not bf16:
        torch.testing.assert_close(
            got4, torch.ops.radixserve.q4_linear(x, qs, scale, minimum), rtol=1e-4, atol=1e-4
        )
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.radixserve.q4_dense(x[:, :992], qs, scale, minimum, bf16)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.radixserve.q8_dense(x[:, :992], q8, d8, bf16)
    with pytest.raises(RuntimeError, match="d, m"):
        torch.ops.radixserve.q4_dense(x, qs, scale[:, :3].contiguous(), minimum, bf16)
    empty = torch.ops.radixserve.q4_dense(x[:0], qs, scale, minimum, bf16)
    assert empty.shape == (0, n)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_dense_threshold_follows_the_gemm_dtype(native_bf16, untiled, monkeypatch) -> None:
    """A bf16 model on a CPU with native bf16 takes the dense GEMM from DENSE_ROWS_BF16 rows,
    elsewhere from DENSE_ROWS (an fp32 model always from DENSE_ROWS)."""
    monkeypatch.setattr(quantization, "cpu_has_bf16", lambda: native_bf16)
    assert quantization.gemm_in_bf16(torch.bfloat16) is native_bf16
    assert not quantization.gemm_in_bf16(torch.float32)
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(64, 128, generator=gen) * 0.05
    ops = torch.ops.radixserve
    for method in ("int4", "int8"):
        layer = QuantizedLinear(method, w)
        args = (layer.qs, layer.d, layer.m) if method == "int4" else (layer.qs, layer.d)
        kernel, dense = (
            (ops.q4_linear, ops.q4_dense) if method == "int4" else (ops.q8_linear, ops.q8_dense)
        )
        for dtype in (torch.bfloat16, torch.float32):
            bf16 = dtype == torch.bfloat16 and native_bf16
            threshold = DENSE_ROWS_BF16 if bf16 else DENSE_ROWS
            for rows in (threshold - 1, threshold):
                x = torch.randn(rows, 128, generator=gen).to(dtype)
                want = dense(x, *args, bf16) if rows == threshold else kernel(x, *args)
                assert torch.equal(layer(x), want.to(dtype)), (method, dtype, rows)


def test_int8_outputs_not_in_whole_tiles_keep_the_q8_kernels() -> None:
    """A weight whose outputs do not fill tiles of 16 (here 40) stays in the q8 layout on
    every CPU, with its float activations, and still matches its dequantized weight."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(40, 64, generator=gen) * 0.05
    layer = QuantizedLinear("int8", w)
    assert layer.kernel == "q8"
    x = torch.randn(3, 64, generator=gen)
    codes, scale = quantize_q8(w)
    deq = codes.float() * scale.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-5, atol=1e-5)


def test_q8_requantizing_a_q8_0_tensor_keeps_its_codes() -> None:
    """A GGUF Q8_0 tensor (the default model's embedding, which is its output head) is
    dequantized at load; int8 quantizes it again onto the file's own grid: same codes, and
    the same scale up to float rounding."""
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8)
    codes[:, ::INT4_GROUP_SIZE] = 127  # each block's largest code is ±127, as in ggml
    scale = (torch.rand(64, 3, generator=gen) * 0.01 + 1e-4).half().float()  # fp16 in GGUF
    w = codes.float() * scale.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    got, got_scale = quantize_q8(w)
    assert torch.equal(got, codes)
    assert torch.allclose(got_scale, scale, rtol=1e-6, atol=0)
