"""Loading with `--quantization`: GGUF Q4 codes kept under int4, every linear quantized, the
real default model's perplexity within a bound of fp32, and the flag's validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import test_gguf_loader
import torch
from gguf import GGMLQuantizationType as QT
from test_gguf_loader import LAYER_QTYPES, PROJ_HF, write_tiny_gguf

import radixserve.args as rs_args
from radixserve.args import ServerArgs
from radixserve.layers.quantization import QuantizedLinear, dequantize_int4, quantize_int4
from radixserve.model_loader.gguf_loader import iter_gguf_weights, stored_quantization
from radixserve.model_loader.loader import _block_params_by_weight, load_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_q4_tensors_keep_their_codes_in_fused_weights(tmp_path: Path, arch: str) -> None:
    """Every row of a fused weight that came from a Q4_0 / Q4_1 tensor (q/k un-permuted on
    llama) is reproduced exactly by the int4 codes and the file's block parameters."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, tie=False)
    fp32, _ = load_model(str(path), "gguf", "float32", "cpu")
    q4: dict = {}
    for _ in iter_gguf_weights(str(path), show_progress=False, q4_blocks=q4):
        pass
    q4_sources = {
        f"model.layers.{i}.{PROJ_HF[p]}.weight"
        for i, layer in enumerate(LAYER_QTYPES)
        for p, t in layer.items()
        if t in (QT.Q4_0, QT.Q4_1)
    } | {"lm_head.weight"}
    assert set(q4) == q4_sources  # every Q4 tensor, and only those, has block parameters
    blocks = _block_params_by_weight(fp32, q4)
    assert "model.layers.1.self_attn.qkv_proj.weight" in blocks  # k (Q4_0) inside qkv
    params = dict(fp32.named_parameters())
    checked = 0
    for name, rows in blocks.items():
        weight = params[name].detach()
        codes, scale, minimum = quantize_int4(weight, rows)
        deq = dequantize_int4(codes, scale, minimum)
        for b in rows:
            sl = slice(b.row_offset, b.row_offset + b.scale.shape[0])
            assert torch.equal(deq[sl], weight[sl]), name
            checked += 1
    assert checked == len(q4)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_tiny_gguf_model_tracks_fp32_logits(tmp_path: Path, method: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tie=True)
    ref, _ = load_model(str(path), "gguf", "float32", "cpu")
    model, _ = load_model(str(path), "gguf", "float32", "cpu", quantization=method)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer + the tied head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lm_head.method == "int8"  # the head stays 8-bit under int4
    assert {m.method for m in linears[:-1]} == {method}
    hidden = torch.randn(5, ref.config.hidden_size)
    want = ref.compute_logits(hidden)
    got = model.compute_logits(hidden)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


def test_quantization_flag_validation() -> None:
    assert ServerArgs(quantization="int4").resolve().quantization == "int4"
    assert ServerArgs().quantization is None
    with pytest.raises(ValueError, match="--quantization must be one of"):
        ServerArgs(quantization="int3")
    with pytest.raises(ValueError, match="CPU kernels"):
        ServerArgs(quantization="int8", device="cuda").resolve()


def test_default_model_perplexity_within_bounds_of_fp32(default_gguf: str, monkeypatch) -> None:
    """The quality check: mean NLL of the same text through each configuration's ModelRunner
    (int4 layers keep the file's Q4_1 codes; the int8 head is the only new rounding). The
    windows are prefills, so int4 and int8 run their GEMMs (the tiled kernels on a CPU with
    AVX-512 VNNI, else the dequantized GEMMs); "int8-untiled" is int8 as on a CPU without VNNI
    (its activations stay in floats), "int4-gemv" sends every row through q4_linear; all other
    int4 and int8 paths quantize the activations to int8 per group."""
    from radixserve.bench.perplexity import default_text, score
    from radixserve.layers import quantization
    from radixserve.managers.tokenizer_utils import load_tokenizer_for
    from radixserve.model_executor.model_runner import ModelRunner

    base = ServerArgs(model_path=default_gguf, max_total_tokens=600, dtype="float32")
    text = default_text()[:8000]
    ids = load_tokenizer_for(base)(text, add_special_tokens=False)["input_ids"][:512]
    ppl = {}
    for name in (None, "int8", "int4", "int8-untiled", "int4-gemv", "w8a8_int8"):
        method = name.split("-")[0] if name else None
        if name == "int8-untiled":
            monkeypatch.setattr(quantization, "tiled_supported", lambda: False)
        if name == "int4-gemv":
            monkeypatch.setattr(quantization, "DENSE_ROWS", 10**9)
            monkeypatch.setattr(quantization, "DENSE_ROWS_BF16", 10**9)
            monkeypatch.setattr(quantization, "tiled_supported", lambda: False)
        runner = ModelRunner(ServerArgs(**{**base.__dict__, "quantization": method}).resolve())
        total, count = score(runner, ids, 256)
        assert count == 510
        ppl[name] = math.exp(total / count)
        assert runner.token_to_kv_pool_allocator.available_size() == runner.max_total_num_tokens
    assert 5 < ppl[None] < 40, ppl  # the model reads Python's docs well
    assert ppl["int8"] / ppl[None] < 1.02, ppl
    assert ppl["int8-untiled"] / ppl[None] < 1.02, ppl
    assert ppl["int4"] / ppl[None] < 1.02, ppl
    assert ppl["int4-gemv"] / ppl[None] < 1.02, ppl
    # Activations rounded to int8 per token cost more: +3.5% on these 510 tokens, +0.7% on
    # 2,044 in bf16 (docs/performance.md). Without SmoothQuant's smoothing this text lost 6.6%.
    assert ppl["w8a8_int8"] / ppl[None] < 1.06, ppl
    # Both int4 paths compute one function up to float order (7.6e-7 apart on a real layer);
    # since activation rounding is discontinuous, that noise can flip roundings downstream,
    # so the perplexities agree closely, not exactly (0.3% apart on this text).
    assert abs(ppl["int4-gemv"] / ppl["int4"] - 1) < 0.01, ppl


def _tiny_gguf_of(tmp_path: Path, monkeypatch, name: str, qtypes: list[QT]) -> str:
    """The tiny two-layer llama with its block linears stored as qtypes, in turn."""
    layers = [
        {proj: qtypes[(i * len(PROJ_HF) + j) % len(qtypes)] for j, proj in enumerate(PROJ_HF)}
        for i in range(len(LAYER_QTYPES))
    ]
    monkeypatch.setattr(test_gguf_loader, "LAYER_QTYPES", layers)
    path = tmp_path / f"{name}.gguf"
    write_tiny_gguf(path, "llama", tie=False)
    return str(path)


def test_w8a8_calibrates_on_as_many_tokens_whatever_the_pool(tmp_path: Path) -> None:
    """SmoothQuant's factors (and so the quantized weights) follow from the calibration
    prefill, which took min(512, pool - 1, context) tokens: two servers of one model sized
    apart ran two models (35 of 40 greedy tokens apart), and a one-token pool ended in a
    traceback after the load. A pool or context too small for it is refused now."""
    from rs_testing import make_tiny_served_model

    from radixserve.model_executor.model_runner import ModelRunner

    model = make_tiny_served_model(str(tmp_path / "m"))

    def runner(**kw: int) -> ModelRunner:
        args = dict(model_path=model, device="cpu", dtype="float32", quantization="w8a8_int8")
        return ModelRunner(ServerArgs(**args, **kw).resolve())

    def factors(r: ModelRunner) -> list[torch.Tensor]:
        return [layer.input_layernorm.smoothed_by for layer in r.model.model.layers]

    big, small = runner(max_total_tokens=4096), runner(max_total_tokens=600, context_length=600)
    assert all(torch.equal(a, b) for a, b in zip(factors(big), factors(small), strict=True))
    for kw in ({"max_total_tokens": 300}, {"max_total_tokens": 1}, {"context_length": 200}):
        with pytest.raises(ValueError, match="w8a8_int8 calibrates on 512 tokens"):
            runner(**kw)


def test_loading_a_quantized_gguf_says_which_flag_runs_it_as_stored(
    tmp_path: Path, monkeypatch, caplog, default_gguf: str
) -> None:
    """Dequantized on load (the default), a GGUF of Q4 or Q8_0 block weights logs the
    --quantization that would keep them: all Q4 -> int4, Q4 and Q8_0 -> int8; nothing for
    float, mixed or Q5 files, or when a method was given."""
    files = {
        "q4": _tiny_gguf_of(tmp_path, monkeypatch, "q4", [QT.Q4_0, QT.Q4_1]),
        "q8": _tiny_gguf_of(tmp_path, monkeypatch, "q8", [QT.Q8_0, QT.Q4_1, QT.Q8_0]),
        "mixed": _tiny_gguf_of(tmp_path, monkeypatch, "mixed", [QT.Q4_0, QT.F16]),
        "q5": _tiny_gguf_of(tmp_path, monkeypatch, "q5", [QT.Q4_0, QT.Q5_1]),
    }
    assert stored_quantization(files["q4"]) == ("int4", ["Q4_0", "Q4_1"])
    assert stored_quantization(files["q8"]) == ("int8", ["Q4_1", "Q8_0"])
    assert stored_quantization(files["mixed"])[0] is None
    assert stored_quantization(files["q5"])[0] is None
    assert stored_quantization(default_gguf) == ("int4", ["Q4_1"])
    caplog.set_level("INFO", logger="radixserve.model_loader.loader")
    for name, want in (("q4", "int4"), ("q8", "int8"), ("mixed", None), ("q5", None)):
        caplog.clear()
        load_model(files[name], "gguf", "float32", "cpu")
        hints = [m for r in caplog.records if "runs them as stored" in (m := r.getMessage())]
        if want is None:
            assert hints == [], name
        else:
            assert len(hints) == 1 and f"--quantization {want} " in hints[0], (name, hints)
    caplog.clear()
    load_model(files["q4"], "gguf", "float32", "cpu", quantization="int4")
    assert not [r for r in caplog.records if "runs them as stored" in r.getMessage()]
    # On a CPU with AMX, bf16 (on the tile unit) stays ahead for prompts and full batches.
    for amx, dtype, said in (
        (True, "bfloat16", True),
        (False, "bfloat16", False),
        (True, "float32", False),
    ):
        monkeypatch.setattr(rs_args, "cpu_has_amx", lambda amx=amx: amx)
        caplog.clear()
        load_model(files["q4"], "gguf", dtype, "cpu")
        hints = [m for r in caplog.records if "runs them as stored" in (m := r.getMessage())]
        assert len(hints) == 1 and ("with AMX, as here, bf16 runs" in hints[0]) == said, hints
