"""W8A8 int8 linear layers (`--quantization w8a8_int8`, csrc/w8a8_linear.cpp): the kernel
against its definition computed in torch (bitwise: the same integer sums and the same float
operations in the same order), against the unquantized product (within int8 rounding), the
layer and the model wiring, and errors on bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.layers.quantization import (
    SMOOTH_ALPHA,
    QuantizedLinear,
    quantize_int8,
    quantize_model,
    smooth_model,
    smoothing_factors,
)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    load_cpu_kernels()


def ref_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sx = max |x| / 127 per row; codes = round(x / sx), ties to even (x · (1 / sx) in fp32)."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / 127.0 if xf.shape[1] else torch.zeros(xf.shape[0])
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(xf * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def ref_w8a8(x, wq, w_scale, bias=None) -> torch.Tensor:
    codes, sx = ref_quantize_rows(x)
    acc = (codes.long() @ wq.long().t()).float()  # exact: |sums| < 2^24 at these sizes
    y = acc * sx[:, None] * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    wq, scale = quantize_int8(w)
    return w, wq.contiguous(), scale.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 576, 192), (7, 100, 37), (64, 33, 16), (600, 96, 50)])
def test_quantize_rows_equals_its_definition(dtype, m, k, n) -> None:
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * 3).to(dtype)
    x[0, : k // 2] = 0  # a row's tie-free half
    if m > 2:
        x[2] = 0  # a zero row: scale 0, codes 0
    codes, scale = torch.ops.radixserve.w8a8_quantize_rows(x)
    want_codes, want_scale = ref_quantize_rows(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes, want_codes)
    assert codes.abs().max() == 127  # every nonzero row reaches ±127


def test_quantize_rows_rounds_ties_to_even() -> None:
    # amax 127 → scale 1, inv 1: the codes are round(x) exactly, ties to even.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49]])
    codes, scale = torch.ops.radixserve.w8a8_quantize_rows(x)
    assert scale.item() == 1.0
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 64, 513, 1100])  # 513 and 1100 cross the 512-row products
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_linear_equals_its_definition_bitwise(dtype, m, with_bias) -> None:
    k, n = 96, 37  # neither a multiple of 16: the vector tails
    _, wq, w_scale = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1000 + m)).to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    got = torch.ops.radixserve.w8a8_linear(x, wq, w_scale, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    assert torch.equal(got, ref_w8a8(x, wq, w_scale, bias))


def test_w8a8_linear_tracks_the_unquantized_product() -> None:
    """Per-token int8 activations and per-channel int8 weights: each output within ~1% of the
    row's largest, on a real layer's shape."""
    w, wq, w_scale = _weight(1536, 576, seed=3)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(4))
    got = torch.ops.radixserve.w8a8_linear(x, wq, w_scale, None)
    want = F.linear(x, w)
    err = (got - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    assert err.max() < 0.02, err.max()
    # A coarser quantization would be caught: rounding the weight to 4 bits is far worse.
    assert (
        F.linear(x, torch.round(w * 7 / w.abs().amax()) * w.abs().amax() / 7) - want
    ).abs().max() > 5 * (got - want).abs().max()


def test_w8a8_linear_handles_empty_and_non_contiguous_inputs() -> None:
    _, wq, w_scale = _weight(24, 64, seed=5)
    assert torch.ops.radixserve.w8a8_linear(torch.randn(0, 64), wq, w_scale, None).shape == (0, 24)
    x = torch.randn(64, 10).t()  # [10, 64], not contiguous
    assert torch.equal(
        torch.ops.radixserve.w8a8_linear(x, wq, w_scale, None), ref_w8a8(x, wq, w_scale)
    )


def test_w8a8_linear_refuses_bad_inputs() -> None:
    _, wq, w_scale = _weight(24, 64, seed=6)
    x = torch.randn(3, 64)
    op = torch.ops.radixserve.w8a8_linear
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.randn(3, 65), wq, w_scale, None)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        op(x.double(), wq, w_scale, None)
    with pytest.raises(RuntimeError, match="int8"):
        op(x, wq.float(), w_scale, None)
    with pytest.raises(RuntimeError, match="w_scale"):
        op(x, wq, w_scale[:-1], None)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, wq, w_scale, torch.randn(24, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="2-D"):
        op(x[None], wq, w_scale, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_w8a8_layer(dtype) -> None:
    lin = nn.Linear(80, 48, bias=True)
    layer = QuantizedLinear("w8a8_int8", lin.weight.detach(), lin.bias.detach()).to(dtype)
    assert layer.kernel == "w8a8" and layer.wq.dtype == torch.int8
    assert layer.w_scale.dtype == torch.float32  # kept through the model's dtype cast
    x = torch.randn(2, 3, 80).to(dtype)
    got = layer(x)
    assert got.shape == (2, 3, 48) and got.dtype == dtype
    want = ref_w8a8(x.reshape(6, 80), layer.wq, layer.w_scale, layer.bias).reshape(2, 3, 48)
    assert torch.equal(got, want)


def test_quantize_model_w8a8_keeps_the_head(tiny_llama_dir) -> None:
    from radixserve.model_loader.loader import load_model

    model, cfg = load_model(tiny_llama_dir, "safetensors", "float32", "cpu")
    ref, _ = load_model(tiny_llama_dir, "safetensors", "float32", "cpu")
    quantize_model(model, "w8a8_int8")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * cfg.num_hidden_layers
    assert {m.kernel for m in layers} == {"w8a8"}
    assert not isinstance(model.lm_head, QuantizedLinear)  # head (tied or not) unquantized
    hidden = torch.randn(4, cfg.hidden_size)
    assert torch.equal(model.compute_logits(hidden), ref.compute_logits(hidden))


def test_smoothing_factors_are_powers_of_two() -> None:
    w = torch.ones(4, 3)
    w[:, 1] = 4.0
    act = torch.tensor([16.0, 16.0, 0.0])
    s = smoothing_factors(act, w)
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))
    want = [2 ** round(math.log2(16**SMOOTH_ALPHA / c ** (1 - SMOOTH_ALPHA))) for c in (1, 4)]
    assert s[:2].tolist() == want and want[0] > want[1]  # a larger weight column takes less
    assert 0 < s[2] < 1  # an unused channel gets a tiny factor, not a NaN


def test_smoothing_leaves_the_unquantized_model_bitwise_unchanged(tiny_llama_dir) -> None:
    """Powers of two move between a norm's weight and the next linear's columns exactly."""
    from radixserve.model_loader.loader import load_model

    model, cfg = load_model(tiny_llama_dir, "safetensors", "float32", "cpu")
    gen = torch.Generator().manual_seed(0)
    amax = {}
    for layer in model.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            amax[lin] = torch.rand(lin.in_features, generator=gen) * 50
    before = {n: p.clone() for n, p in model.named_parameters()}
    x = torch.randn(3, 7, cfg.hidden_size, generator=gen)
    layer = model.model.layers[0]
    want = layer.self_attn.qkv_proj(layer.input_layernorm(x))
    assert smooth_model(model, amax) == 2 * cfg.num_hidden_layers
    got = layer.self_attn.qkv_proj(layer.input_layernorm(x))
    assert torch.equal(got, want)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any("input_layernorm" in n for n in changed) and any("gate_up" in n for n in changed)


def test_runner_calibrates_smooths_and_quantizes(tiny_llama_dir) -> None:
    from radixserve.args import ServerArgs
    from radixserve.model_executor.model_runner import ModelRunner

    args = ServerArgs(
        model_path=tiny_llama_dir, device="cpu", max_total_tokens=4096, quantization="w8a8_int8"
    ).resolve()
    runner = ModelRunner(args)
    ref = ModelRunner(ServerArgs(**{**args.__dict__, "quantization": None}).resolve())
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * len(runner.model.model.layers)
    # the norms carry the smoothing: their weights differ from the reference by powers of two
    norm = runner.model.model.layers[0].input_layernorm.weight
    ratio = ref.model.model.layers[0].input_layernorm.weight / norm
    assert not torch.equal(ratio, torch.ones_like(ratio))
    assert torch.equal(torch.log2(ratio), torch.round(torch.log2(ratio)))
    # the calibration prefill gave its slots back
    assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
