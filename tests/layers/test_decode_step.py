"""The C++ decode step (layers/decode_step.py, csrc/decode_step.cpp) against the Python layers
it replaces: bitwise the same logits in every configuration it takes (fp32 and bf16, dense
(bf16 in tiles), int8 and int4 weights, W8A8, qkv biases, pages of 1 and 16 slots, 1 to 63 rows), and the layer-by-
layer path wherever it must not run (64 rows and more, shared-prefix groups, Qwen3's q/k norms,
the portable backend, the flag)."""

from __future__ import annotations

import pytest
import torch
from rs_testing import greedy_step_logits, make_tiny_model_dir, prefill_batch

from radixserve.args import ServerArgs
from radixserve.layers import quantization as quant
from radixserve.layers.decode_step import CpuDecodeStep
from radixserve.layers.fused_ops import set_fused_ops
from radixserve.layers.linear import Linear, bf16_tiles_supported
from radixserve.layers.quantization import DENSE_ROWS, DENSE_ROWS_BF16
from radixserve.model_executor.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory) -> str:  # qkv biases
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2")


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory) -> str:  # per-head q/k norms
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3")


def _runner(model_path: str, **kwargs) -> ModelRunner:
    args = dict(model_path=model_path, device="cpu", max_total_tokens=8192)
    return ModelRunner(ServerArgs(**{**args, **kwargs}).resolve())


class _Counter:
    """Counts the decode steps that ran through the C++ step."""

    def __init__(self, step: CpuDecodeStep) -> None:
        self.calls = 0
        self._run = step.run
        step.run = self  # type: ignore[method-assign]

    def __call__(self, *args):
        self.calls += 1
        return self._run(*args)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 90, (n,), generator=gen).tolist()
    return [torch.randint(3, 320, (k,), generator=gen).tolist() for k in lens]


def _compare(runner: ModelRunner, prompts: list[list[int]], steps: int = 3) -> int:
    """Runs the workload with and without the C++ step; asserts bitwise equal logits and
    returns how many steps took the C++ step."""
    step = runner.model.model.decode_step
    assert isinstance(step, CpuDecodeStep)
    counter = _Counter(step)
    fast = greedy_step_logits(runner, prompts, steps)
    runner.model.model.decode_step = None
    slow = greedy_step_logits(runner, prompts, steps)
    runner.model.model.decode_step = step
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)
    return counter.calls


@pytest.mark.parametrize(
    "arch,dtype,quantization,page_size,kv",
    [
        ("llama", "float32", None, 1, "auto"),
        ("llama", "bfloat16", None, 1, "auto"),
        ("qwen2", "bfloat16", None, 16, "auto"),  # bf16 tiles with the qkv bias inside the kernel
        ("llama", "float32", "int4", 1, "auto"),
        ("llama", "float32", "int8", 16, "auto"),
        ("llama", "bfloat16", "int4", 16, "auto"),
        ("qwen2", "float32", None, 16, "auto"),
        ("qwen2", "float32", "int4", 1, "auto"),
        ("llama", "bfloat16", "w8a8_int8", 16, "auto"),
        ("qwen2", "float32", "w8a8_int8", 1, "auto"),
        ("llama", "bfloat16", None, 1, "fp8_e4m3"),  # an fp8 KV pool: the same stored bytes
        ("qwen2", "float32", None, 16, "fp8_e5m2"),
    ],
)
def test_the_cpp_step_equals_the_python_layers_bitwise(
    tiny_llama_dir, tiny_qwen2_dir, arch, dtype, quantization, page_size, kv
):
    path = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[arch]
    runner = _runner(
        path, dtype=dtype, quantization=quantization, page_size=page_size, kv_cache_dtype=kv
    )
    assert _compare(runner, _prompts(5), steps=4) == 4  # every decode step took it


@pytest.mark.parametrize(
    "dtype,quantization,tiled,rows",
    [
        # fp32: the q4 / q8 kernels below DENSE_ROWS (64) rows, their dense GEMMs from there on
        ("float32", "int4", False, (DENSE_ROWS - 1, DENSE_ROWS, 150)),
        ("float32", "int8", False, (DENSE_ROWS - 1, DENSE_ROWS)),
        # bf16: from DENSE_ROWS_BF16 (12) where the GEMM runs in bf16, else 64
        ("bfloat16", "int4", False, (DENSE_ROWS_BF16 - 1, DENSE_ROWS_BF16, DENSE_ROWS)),
        ("bfloat16", "int8", False, (DENSE_ROWS_BF16, DENSE_ROWS)),
        # int4 and int8 in tiles (a CPU with AVX-512 VNNI): one kernel at every size
        ("float32", "int4", True, (1, 9, DENSE_ROWS, 150)),
        ("bfloat16", "int4", True, (1, 9, DENSE_ROWS)),
        ("float32", "int8", True, (1, 9, DENSE_ROWS)),
        ("bfloat16", "int8", True, (1, 9, DENSE_ROWS, 150)),
    ],
)
def test_quantized_models_take_the_step_on_both_sides_of_the_dense_threshold(
    tiny_llama_dir, dtype, quantization, tiled, rows, monkeypatch
):
    """The step runs the same kernel or dense GEMM as the layers at every size, bitwise."""
    if tiled and not quant.tiled_supported():
        pytest.skip("the tiled kernels are built for CPUs with AVX-512 VNNI only")
    monkeypatch.setattr(quant, "tiled_supported", lambda: tiled)
    runner = _runner(tiny_llama_dir, dtype=dtype, quantization=quantization)
    kind = ("q4" if quantization == "int4" else "q8") + ("_tiled" if tiled else "")
    for layer in runner.model.model.layers:
        mlp, attn = layer.mlp, layer.self_attn
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert lin.kernel == kind
    for i, n in enumerate(rows):
        assert _compare(runner, _prompts(n, seed=i + 1), steps=2) == 2, n


@pytest.mark.parametrize(
    "dtype,quantization",
    [
        ("float32", "int4"),
        ("bfloat16", "int4"),
        ("float32", "int8"),
        ("bfloat16", "int8"),
        ("bfloat16", None),  # bf16 tiles (layers/linear.py)
    ],
)
def test_tiled_mlps_fuse_the_silu_into_the_gate_up_kernel(
    tiny_llama_dir, dtype, quantization, monkeypatch
):
    """With [gate; up] in tiles, the MLP's product, SiLU and multiply are one kernel in
    prefill (the layers) and in decode (the C++ step), and the logits are bitwise those of
    the product followed by silu_and_mul."""
    if quantization is None:
        if not bf16_tiles_supported():
            pytest.skip(
                "bf16 tiles need radixserve's kernels built with AVX512-BF16 (and AMX on an AMX CPU)"
            )
        fused_op = "radixserve::bf16_tiled_silu_mul"
    elif not quant.tiled_supported():
        pytest.skip("the tiled kernels are built for CPUs with AVX-512 VNNI only")
    else:
        fused_op = f"radixserve::q{4 if quantization == 'int4' else 8}_tiled_silu_mul"
    runner = _runner(tiny_llama_dir, dtype=dtype, quantization=quantization)
    prompts = _prompts(4, seed=3)
    with torch.profiler.profile() as prof:
        fused = greedy_step_logits(runner, prompts, 2)
    names = [e.name for e in prof.events()]
    layers = len(runner.model.model.layers)
    assert names.count(fused_op) == 3 * layers  # the prefill and both decode steps
    assert "radixserve::silu_and_mul" not in names
    runner.model.model.decode_step = None
    monkeypatch.setattr(quant.QuantizedLinear, "silu_and_mul", lambda self, x: None)
    monkeypatch.setattr(Linear, "silu_and_mul", lambda self, x: None)
    with torch.profiler.profile() as prof:
        apart = greedy_step_logits(runner, prompts, 2)
    assert fused_op not in [e.name for e in prof.events()]
    for got, want in zip(fused, apart, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "w8a8_int8")]
)
def test_dense_and_w8a8_models_take_the_step_at_any_batch_size(tiny_llama_dir, dtype, quantization):
    runner = _runner(tiny_llama_dir, dtype=dtype, quantization=quantization)
    assert _compare(runner, _prompts(DENSE_ROWS + 1, seed=3), steps=2) == 2
    assert _compare(runner, _prompts(150, seed=4), steps=2) == 2


def test_shared_prefix_groups_keep_to_the_layers(tiny_llama_dir):
    """Requests whose rows share slots attend them as a cascade group: that merge stays in
    Python, so such a step runs layer by layer."""
    runner = _runner(tiny_llama_dir)
    prefix = list(range(10, 90))  # at least MIN_SHARED_PREFIX (64) slots
    shared = [prefix + [70 + i, 80 + i] for i in range(3)]
    # A radix cache would share the prefix's slots; the test gives the rows the same slots.
    counter = _Counter(runner.model.model.decode_step)
    batch = prefill_batch(runner, shared)
    runner.forward(batch.get_forward_batch("cpu"))
    pool, reqs = runner.req_to_token_pool, batch.reqs
    first = pool.req_to_token[reqs[0].req_pool_idx, : len(prefix)].clone()
    for r in reqs[1:]:  # point the others' prefix at the first request's slots
        pool.req_to_token[r.req_pool_idx, : len(prefix)] = first
    for r in reqs:
        r.output_ids.append(5)
    batch.prepare_for_decode()
    fb = batch.get_forward_batch("cpu")
    runner.forward(fb)
    assert fb.attn_metadata.groups and counter.calls == 0


def test_models_and_backends_it_cannot_hold_keep_to_the_layers(tiny_llama_dir, tiny_qwen3_dir):
    assert _runner(tiny_qwen3_dir).model.model.decode_step is None  # q/k norms
    assert _runner(tiny_llama_dir, attention_backend="torch_native").model.model.decode_step is None
    assert _runner(tiny_llama_dir, disable_cpu_decode_step=True).model.model.decode_step is None
    runner = _runner(tiny_llama_dir)
    assert runner.model.model.decode_step is not None
    set_fused_ops(runner.model, False)  # the reference forms: no C++ step either
    assert runner.model.model.decode_step is None


def test_the_step_refuses_mismatched_inputs(tiny_llama_dir):
    step = _runner(tiny_llama_dir).model.model.decode_step.step
    with pytest.raises(RuntimeError, match="one K and one V buffer per layer"):
        step.run(
            torch.zeros(1, 64),
            torch.zeros(1, 16),
            torch.zeros(1, 16),
            [],
            [],
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
        )
    with pytest.raises(RuntimeError, match="4 linear kinds per layer"):
        torch.classes.radixserve.DecodeStep([], [0], 4, 2, 16, 0.25, 1e-6, 64, 64, False)
    with pytest.raises(RuntimeError, match="fewer parameters"):
        torch.classes.radixserve.DecodeStep([], [0, 0, 0, 0], 4, 2, 16, 0.25, 1e-6, 64, 64, False)
