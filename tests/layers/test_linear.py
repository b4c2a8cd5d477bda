"""Prepacked bf16 linear weights (layers/linear.py): radixserve's bf16 tiles where their kernel
runs (csrc/bf16_linear.cpp), else oneDNN's blocked copy, made once; products through either agree
with F.linear, the tiles' rows do not depend on the batch and their MLP kernel applies the SiLU
bitwise as silu_and_mul, on AVX512-BF16's dot products and (where the CPU has it) on AMX; a model's Linears (and a tied output head) switch to the packed copy
and let their plain weights go, as accurate against fp32 as the plain bf16 model; nothing is
packed where bf16 matmuls are not native."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers import linear as linear_mod
from radixserve.layers.linear import (
    Linear,
    bf16_tiles,
    bf16_tiles_supported,
    linear,
    prepack,
    prepack_linears,
    tile_layout,
)


@pytest.fixture
def native_bf16():
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    if prepack(w) is None:
        pytest.skip("this CPU has no native bf16 matmuls: weights are not prepacked here")


@pytest.fixture
def tiles_run(native_bf16):
    if not bf16_tiles_supported():
        pytest.skip(
            "bf16 tiles need radixserve's kernels built with AVX512-BF16 (and AMX on an AMX CPU)"
        )


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, True), (50, 40, True)])
@pytest.mark.parametrize("form", ["prepack", "onednn"])
def test_prepacked_products_agree_with_f_linear(native_bf16, rows, n, k, bias, form):
    gen = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, rows, k, generator=gen).bfloat16()  # leading dims are kept
    packed = prepack(w) if form == "prepack" else torch.ops.mkldnn._reorder_linear_weight(w)
    if form == "prepack" and bf16_tiles(w) is not None:
        assert not packed.is_mkldnn  # the tiles where they apply
    got = linear(x, torch.empty(0, k, dtype=torch.bfloat16), b, packed=packed)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (2, rows, n) and got.dtype == torch.bfloat16
    # bf16 output: within a few units of its last place of the fp32 product
    torch.testing.assert_close(got.float(), want, atol=0.05 * k**0.5 / 8, rtol=2e-2)


def test_bf16_tiles_layout_and_where_they_apply(tiles_run, monkeypatch):
    w = torch.arange(48 * 6, dtype=torch.float32).reshape(48, 6).bfloat16()
    monkeypatch.setattr(linear_mod, "cpu_has_amx", lambda: False)  # any even K on vdpbf16ps
    t = bf16_tiles(w)
    assert t.shape == (3, 3, 32) and t.is_contiguous() and torch.equal(t, tile_layout(w))
    for tile, pair, i, j in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 5, 1), (2, 1, 15, 0)]:
        assert t[tile, pair, 2 * i + j] == w[16 * tile + i, 2 * pair + j]
    assert bf16_tiles(torch.zeros(40, 6, dtype=torch.bfloat16)) is None  # not whole tiles
    assert bf16_tiles(torch.zeros(48, 5, dtype=torch.bfloat16)) is None  # an odd K
    assert prepack(torch.zeros(40, 6, dtype=torch.bfloat16)).is_mkldnn  # oneDNN's copy there
    # On an AMX CPU the tiles take K in steps of 32 (the tile unit's) and oneDNN the rest.
    monkeypatch.setattr(linear_mod, "cpu_has_amx", lambda: True)
    assert bf16_tiles(w) is None and prepack(w).is_mkldnn
    w64 = torch.zeros(48, 64, dtype=torch.bfloat16)
    on_amx = bool(torch.ops.radixserve.bf16_tiled_amx())  # this build has AMX, granted
    assert (bf16_tiles(w64) is not None) == on_amx and prepack(w64).is_mkldnn != on_amx


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [176, 464])
@pytest.mark.parametrize("k", [96, 80])
def test_a_rows_tile_product_does_not_depend_on_the_batch(tiles_run, bias, n, k):
    """One fixed order of sums per output: each row bitwise the same alone, in any batch of
    any size (passes of 4 rows and the tails of 1-3; one or two rows in passes of up to 12 or
    8 tiles; on AMX, K = 96: blocks of 32 rows in two tiles of 16 and the tails, pairs of
    tiles and an odd one), at any position. K = 80 runs on vdpbf16ps on every CPU."""
    gen = torch.Generator().manual_seed(5)
    # 11 tiles: passes of 4 tiles and a tail of 3 on one thread, 2 on another, one pass at
    # one row; 29: 12 + 3 / 12 + 2 tiles at one row, 8 + 7 / 8 + 6 at two
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    packed = tile_layout(w)
    x = torch.randn(300, k, generator=gen).bfloat16()
    alone = torch.cat(
        [torch.ops.radixserve.bf16_tiled_linear(x[i : i + 1], packed, b) for i in range(300)]
    )
    for m in (2, 3, 4, 5, 9, 17, 33, 64, 300):
        got = torch.ops.radixserve.bf16_tiled_linear(x[300 - m :], packed, b)
        assert torch.equal(got, alone[300 - m :]), m
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert ((alone.double() - ref).abs().max() <= 1e-2 * ref.abs().max()).item()
    assert torch.ops.radixserve.bf16_tiled_linear(x[:0], packed, b).shape == (0, n)


@pytest.mark.parametrize("rows", [1, 2, 6, 17, 64, 300])
@pytest.mark.parametrize("inter", [96, 240])  # 6 / 15 gate tiles (passes of up to 6 or 4)
def test_the_tiled_mlp_kernel_is_the_product_then_silu_and_mul(tiles_run, rows, inter):
    gen = torch.Generator().manual_seed(rows)
    hidden = 64  # a multiple of 32: on AMX where the CPU has it
    lin = Linear(hidden, 2 * inter, bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2 * inter, hidden, generator=gen))
    assert prepack_linears(torch.nn.Sequential(lin)) == 1 and not lin.packed.is_mkldnn
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    want = torch.ops.radixserve.silu_and_mul(lin(x))
    assert torch.equal(lin.silu_and_mul(x), want)
    odd = Linear(hidden, 2 * 40, bias=False).bfloat16()  # a gate of 40: not whole tiles
    prepack_linears(torch.nn.Sequential(odd))
    assert odd.silu_and_mul(x) is None


def test_bf16_tiled_ops_refuse_bad_inputs(tiles_run):
    wt = tile_layout(torch.zeros(32, 8, dtype=torch.bfloat16))
    op = torch.ops.radixserve.bf16_tiled_linear
    with pytest.raises(RuntimeError, match="x has 6 columns"):
        op(torch.zeros(2, 6, dtype=torch.bfloat16), wt)
    with pytest.raises(RuntimeError, match="bf16"):
        op(torch.zeros(2, 8), wt)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(torch.zeros(2, 8, dtype=torch.bfloat16), wt, torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="whole tiles"):
        torch.ops.radixserve.bf16_tiled_silu_mul(
            torch.zeros(2, 8, dtype=torch.bfloat16),
            tile_layout(torch.zeros(48, 8, dtype=torch.bfloat16)),
        )


def test_nothing_is_packed_where_it_does_not_apply(monkeypatch):
    assert prepack(torch.zeros(8, 8)) is None  # fp32 stays with F.linear
    assert prepack(torch.zeros(8, dtype=torch.bfloat16)) is None  # not a matrix
    monkeypatch.setattr(linear_mod, "cpu_has_bf16", lambda: False)
    model = torch.nn.Sequential(Linear(8, 8).bfloat16())
    assert prepack_linears(model) == 0
    assert model[0].packed is None and model[0].weight.shape == (8, 8)


def _logits(runner, prompts):
    from rs_testing import greedy_step_logits

    return greedy_step_logits(runner, prompts, steps=2)


@pytest.mark.parametrize("model", ["tiny", "real"])
def test_a_prepacked_model_is_as_accurate_as_the_plain_one(
    native_bf16, request, tiny_llama_dir, model
):
    """Every Linear of the model (the tiny model's own output head, the real model's head tied
    to its embedding) runs on its packed copy and keeps no plain weight; its prefill and decode
    log-probabilities are as close to the fp32 model's as the unpacked bf16 model's (its own
    order of sums: rounding noise of the same size, not the same bits), with the same greedy
    tokens."""
    from radixserve.args import ServerArgs
    from radixserve.model_executor.model_runner import ModelRunner

    path = tiny_llama_dir if model == "tiny" else request.getfixturevalue("default_model_path")
    vocab = 320 if model == "tiny" else 49152
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 40, 130)]

    def runner(dtype: str) -> ModelRunner:
        args = ServerArgs(
            model_path=path,
            dtype=dtype,
            device="cpu",
            max_total_tokens=2048,
            attention_backend="torch_native",  # the portable path leaves its weights as they are
        ).resolve()
        return ModelRunner(args)

    exact = [t.double() for t in _logits(runner("float32"), prompts)]
    bf16 = runner("bfloat16")
    assert all(m.packed is None for m in bf16.model.modules() if type(m) is Linear)
    plain = _logits(bf16, prompts)
    linears = [m for m in bf16.model.modules() if type(m) is Linear]
    count = prepack_linears(bf16.model)
    tied = bf16.model.lm_head is None
    assert count == len(linears) + tied
    assert all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert (bf16.model.packed_head is not None) == tied
    assert prepack_linears(bf16.model) == 0  # once
    packed = _logits(bf16, prompts)

    def error(logits: list[torch.Tensor]) -> torch.Tensor:  # of the log-probabilities, all steps
        return torch.cat(
            [
                (torch.log_softmax(got.double(), -1) - torch.log_softmax(want, -1)).abs().flatten()
                for got, want in zip(logits, exact, strict=True)
            ]
        )

    err, base_err = error(packed), error(plain)
    assert err.max() <= 2 * base_err.max(), (err.max(), base_err.max())
    assert err.mean() <= 1.5 * base_err.mean(), (err.mean(), base_err.mean())
    for got, base in zip(packed, plain, strict=True):
        assert torch.equal(got.argmax(-1), base.argmax(-1))


def test_the_cpu_fast_path_prepacks_at_start_up(native_bf16, tiny_llama_dir):
    from radixserve.args import ServerArgs
    from radixserve.model_executor.model_runner import ModelRunner

    args = ServerArgs(
        model_path=tiny_llama_dir,
        dtype="bfloat16",
        device="cpu",
        max_total_tokens=512,
        attention_backend="cpu_paged",
    ).resolve()
    runner = ModelRunner(args)
    assert all(m.packed is not None for m in runner.model.modules() if type(m) is Linear)


def test_the_start_up_line_names_the_packed_forms(tiles_run):
    from radixserve.args import cpu_has_amx
    from radixserve.layers.linear import packed_form

    tiled, odd = Linear(64, 32, bias=False).bfloat16(), Linear(40, 40, bias=False).bfloat16()
    model = torch.nn.Sequential(tiled, odd)
    assert packed_form(model) == "none"
    assert prepack_linears(model) == 2 and odd.packed.is_mkldnn and not tiled.packed.is_mkldnn
    tiles = "bf16 tiles on AMX" if cpu_has_amx() else "bf16 tiles"
    assert packed_form(model) == f"{tiles} and oneDNN's layout"
