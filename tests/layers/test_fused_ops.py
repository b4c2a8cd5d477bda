"""The fused element-wise kernels (csrc/fused_ops.cpp) against the reference forms they replace
(RMSNorm with and without the residual add, rotary embedding, SiLU·mul), in every dtype, at
decode and prefill row counts, on the strided views the model hands them; the greedy sampler's
argmax against torch.argmax (ties, NaN, -inf rows); the model's logits with them on and off;
and clear errors on bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rs_testing import greedy_step_logits

from radixserve.args import ServerArgs
from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.layers.fused_ops import set_fused_ops
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.model_executor.model_runner import ModelRunner

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 7, 300]  # a decode row, a small batch, a prefill chunk (parallel over rows)


@pytest.fixture(scope="module")
def ops():
    load_cpu_kernels()
    return torch.ops.radixserve


def _norm(hidden: int, dtype: torch.dtype, fused: bool) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(dtype)
    norm.fused = fused
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 64])
def test_rms_norm_and_residual_add_match_the_reference(ops, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    ref, fused = _norm(hidden, dtype, False), _norm(hidden, dtype, True)

    # One rounding step apart at most: the sum of squares is added in another order.
    close = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    torch.testing.assert_close(fused(x), ref(x), **close)

    want_out, want_res = ref(x, residual)
    x2, res2 = x.clone(), residual.clone()
    got_out, got_res = fused(x2, res2)
    assert got_out.data_ptr() == x2.data_ptr() and got_res.data_ptr() == res2.data_ptr()
    assert torch.equal(got_res, want_res)  # the add rounds exactly as the reference's
    torch.testing.assert_close(got_out, want_out, **close)


def test_rms_norm_takes_strided_rows_and_leaves_three_dims_to_the_reference(ops):
    x = torch.randn(5, 2 * 64)[:, :64]  # rows with a stride of 128
    ref, fused = _norm(64, torch.float32, False), _norm(64, torch.float32, True)
    torch.testing.assert_close(fused(x), ref(x))
    heads = torch.randn(5, 4, 64)  # Qwen3's per-head q/k norm: the reference form
    assert torch.equal(fused(heads), ref(heads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (3, 1, 80)])  # 80: a tail
def test_rotary_in_place_on_the_qkv_views_equals_the_reference(ops, dtype, rows, heads):
    hq, hk, d = heads
    rope = RotaryEmbedding(d, 4096, 10000.0)
    gen = torch.Generator().manual_seed(rows + d)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = torch.randn(rows, (hq + 2 * hk) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(rows, hq, d), k.reshape(rows, hk, d)
    assert rows == 1 or not q.is_contiguous()  # views into the projection's output
    want_q, want_k = RotaryEmbedding.apply((cos, sin), q, k)
    v_before = v.clone()

    ops.rotary_embedding(q, k, cos.squeeze(1), sin.squeeze(1))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_the_reference(ops, dtype, rows):
    x = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_holds_over_the_whole_range_of_the_exp(ops, dtype):
    """The vectorized exp across [-100, 100] (its clamps at -87 and 88 included), zeros, an
    odd width (the scalar tail) and non-finite gates, against the reference."""
    gate = torch.cat(
        [
            torch.tensor([float("inf"), float("nan")]),
            torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 88.5, -88.5]),
            torch.linspace(-100, 100, 20001),
        ]
    )
    gate = gate[: gate.numel() // 3 * 3].view(3, -1)  # rows of 6670: a tail past the vectors
    up = torch.linspace(-2, 2, gate.numel()).view_as(gate)
    x = torch.cat([gate, up], dim=1).to(dtype)
    torch.testing.assert_close(
        ops.silu_and_mul(x), F.silu(x[:, : gate.shape[1]]) * x[:, gate.shape[1] :], equal_nan=True
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (7, 1), (7, 17), (65, 1000), (3, 151936)])
def test_argmax_rows_is_torch_argmax(ops, dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    # Rows of a wider buffer (the head's output sliced), and coarse values with many ties.
    wide = torch.randn(rows, vocab + 13, generator=gen).to(dtype)[:, 5 : 5 + vocab]
    assert torch.equal(ops.argmax_rows(wide), wide.argmax(-1))
    ties = torch.randint(0, 3, (rows, vocab), generator=gen).to(dtype)
    assert torch.equal(ops.argmax_rows(ties), ties.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_picks_as_torch_at_the_edges(ops, dtype):
    """The first of equal maxima in every lane position; NaN above everything, the first NaN;
    -inf rows (a grammar mask) give 0; +inf beats finite values."""
    V = 100
    x = torch.zeros(8, V, dtype=dtype)
    x[0, [3, 40, 99]] = 5
    x[1, [70, 17, 18]] = 5
    x[2, 99] = 1
    x[3, [50, 20]] = float("nan")
    x[3, 10] = float("inf")
    x[4] = float("-inf")
    x[5] = float("-inf")
    x[5, 98] = -1e4
    x[6, 33] = float("inf")
    x[7, :] = float("nan")
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    assert ops.argmax_rows(x).tolist() == [3, 17, 99, 20, 0, 98, 33, 0]
    if dtype == torch.float32:  # fp64 (the portable loop) compares in fp64, as torch does
        close = torch.tensor([[1.0, 1.0 + 1e-12, 1.0]], dtype=torch.float64)
        assert ops.argmax_rows(close).item() == 1 == close.argmax(-1).item()
    for pos in range(V):  # one maximum at every position, past the 64-wide blocks too
        y = torch.zeros(1, V, dtype=dtype)
        y[0, pos] = 1
        assert ops.argmax_rows(y).item() == pos


def test_the_sampler_takes_the_kernel_for_greedy_rows(ops):
    from radixserve.layers.sampler import Sampler, SamplingBatchInfo
    from radixserve.sampling_params import SamplingParams

    class _Req:
        def __init__(self, temperature):
            self.sampling_params = SamplingParams(temperature=temperature, max_new_tokens=4)
            self.origin_input_ids, self.output_ids, self.eos_token_ids = [1], [], [0]

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    greedy = SamplingBatchInfo.from_reqs([_Req(0.0) for _ in range(5)], 300, "cpu")
    want = logits.float().argmax(-1)
    assert torch.equal(Sampler(cpu_kernels=True)(logits, greedy).next_token_ids, want)
    assert torch.equal(Sampler()(logits, greedy).next_token_ids, want)
    mixed = SamplingBatchInfo.from_reqs([_Req(0.0), _Req(1.0)] * 2 + [_Req(0.0)], 300, "cpu")
    got = Sampler(cpu_kernels=True)(logits, mixed).next_token_ids
    assert got[[0, 2, 4]].tolist() == want[[0, 2, 4]].tolist()


def test_bad_inputs_are_clear_errors(ops):
    w = torch.ones(64)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(3, 32), w, 1e-5)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        ops.rms_norm(torch.randn(3, 64), w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.add_rms_norm(torch.randn(3, 64), torch.randn(2, 64), w, 1e-5)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary_embedding(q, k, torch.randn(3, 64), torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="share T and an even D"):
        ops.rotary_embedding(q, torch.randn(2, 2, 32), torch.randn(2, 64), torch.randn(2, 64))
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match=r"\[T, V\] with V > 0"):
        ops.argmax_rows(torch.randn(2, 0))


def _runner(model_path: str, backend: str, dtype: str) -> ModelRunner:
    args = ServerArgs(
        model_path=model_path,
        dtype=dtype,
        device="cpu",
        max_total_tokens=4096,
        attention_backend=backend,
    )
    return ModelRunner(args.resolve())


def _prefill_then_decode(runner: ModelRunner, steps: int) -> list[torch.Tensor]:
    """Logits of a ragged prefill and `steps` greedy decode steps of three prompts."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 40, 130)]
    return greedy_step_logits(runner, prompts, steps)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 0.15)])
def test_the_model_with_fused_ops_matches_the_reference_forms(ops, tiny_llama_dir, dtype, atol):
    runner = _runner(tiny_llama_dir, "cpu_paged", dtype)
    assert runner.fused_ops
    fused = _prefill_then_decode(runner, steps=4)
    assert set_fused_ops(runner.model, False) == 2 * 4 + 1  # 2 norms, attention, MLP; final norm
    reference = _prefill_then_decode(runner, steps=4)
    for got, want in zip(fused, reference, strict=True):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_portable_backend_keeps_the_reference_forms(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, "torch_native", "float32")
    assert not runner.fused_ops
    assert not any(getattr(m, "fused", False) for m in runner.model.modules())


def test_every_kernel_header_is_part_of_the_build_name():
    """A header the kernels include must change the cached build's name when it changes."""
    import os

    from radixserve.layers import cpu_kernels

    csrc = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    assert set(cpu_kernels._HEADERS) == {f for f in os.listdir(csrc) if f.endswith(".h")}
