"""Prepacked bf16 linear weights (layers/linear.py): oneDNN's blocked copy made once, products
through it agree with F.linear, a model's Linears (and a tied output head) switch to it and let
their plain weights go, and nothing is packed where bf16 matmuls are not native."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers import linear as linear_mod
from radixserve.layers.linear import Linear, linear, prepack, prepack_linears


@pytest.fixture
def native_bf16():
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    if prepack(w) is None:
        pytest.skip("this CPU has no native bf16 matmuls: weights are not prepacked here")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(("n", "k", "bias"), [(960, 576, False), (576, 1536, True), (50, 40, True)])
def test_prepacked_products_agree_with_f_linear(native_bf16, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(2, rows, k, generator=gen).bfloat16()  # leading dims are kept
    got = linear(x, torch.empty(0, k, dtype=torch.bfloat16), b, packed=prepack(w))
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (2, rows, n) and got.dtype == torch.bfloat16
    # bf16 output: within a few units of its last place of the fp32 product
    torch.testing.assert_close(got.float(), want, atol=0.05 * k**0.5 / 8, rtol=2e-2)


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
def test_a_prepacked_model_gives_the_plain_models_logits(
    native_bf16, request, tiny_llama_dir, model
):
    """Every Linear of the model (the tiny model's own output head, the real model's head tied
    to its embedding) runs on its packed copy and keeps no plain weight; prefill and decode
    logits stay within bf16 rounding of the unpacked model's, with the same greedy tokens."""
    from radixserve.args import ServerArgs
    from radixserve.model_executor.model_runner import ModelRunner

    path = tiny_llama_dir if model == "tiny" else request.getfixturevalue("default_model_path")
    vocab = 320 if model == "tiny" else 49152
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 40, 130)]
    args = ServerArgs(
        model_path=path,
        dtype="bfloat16",
        device="cpu",
        max_total_tokens=2048,
        attention_backend="torch_native",  # the portable path leaves its weights as they are
    ).resolve()
    runner = ModelRunner(args)
    assert all(m.packed is None for m in runner.model.modules() if type(m) is Linear)
    plain = _logits(runner, prompts)
    linears = [m for m in runner.model.modules() if type(m) is Linear]
    count = prepack_linears(runner.model)
    tied = runner.model.lm_head is None
    assert count == len(linears) + tied
    assert all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert (runner.model.packed_head is not None) == tied
    assert prepack_linears(runner.model) == 0  # once
    packed = _logits(runner, prompts)
    for got, want in zip(packed, plain, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=0.15, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


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
