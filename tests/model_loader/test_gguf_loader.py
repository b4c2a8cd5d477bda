"""GGUF loading: config, dequantized and un-permuted weights, tokenizer.

References: the weights we wrote ourselves into tiny GGUFs (several quant types, q/k permuted the
way llama.cpp's converter does it) and transformers' own GGUF loader, on both the tiny files and
the real default model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize
from rs_testing import load_hf_reference

from radixserve.model_loader.gguf_loader import (
    gguf_to_hf_config,
    iter_gguf_weights,
    load_gguf_tokenizer,
    open_gguf,
)
from radixserve.model_loader.model_config import ModelConfig

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 64, 4, 2, 128, 320, 2
# Per layer, the quant type of each projection: every type gguf-py can quantize appears.
LAYER_QTYPES = [
    {
        "q": QT.F32,
        "k": QT.F16,
        "v": QT.BF16,
        "o": QT.Q4_0,
        "gate": QT.Q4_1,
        "up": QT.Q5_0,
        "down": QT.Q5_1,
    },
    {
        "q": QT.Q8_0,
        "k": QT.Q4_0,
        "v": QT.Q8_0,
        "o": QT.F16,
        "gate": QT.Q8_0,
        "up": QT.Q4_1,
        "down": QT.BF16,
    },
]
# Worst-case dequantization error as a fraction of max|w| (half a quantization step, rounded up).
QUANT_ERROR = {
    QT.F32: 0.0,
    QT.F16: 0.0,
    QT.BF16: 2**-8,
    QT.Q8_0: 1 / 127,
    QT.Q5_0: 1 / 15,
    QT.Q5_1: 1 / 15,
    QT.Q4_0: 1 / 7,
    QT.Q4_1: 1 / 7,
}
PROJ_GGUF = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
PROJ_HF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (the inverse of our loader)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(
    path: Path,
    arch: str,
    tie: bool,
    head_dim: int = HIDDEN // HEADS,
    yarn: bool = False,
    eot: int | None = None,
    rope_freqs: np.ndarray | None = None,
) -> dict[str, tuple[np.ndarray, QT]]:
    """Write a random tiny model; return {HF name: (original HF-layout weight, stored type)}."""
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        # float16-representable values, so F32/F16 tensors round-trip exactly
        return (rng.standard_normal(shape) * 0.1).astype(np.float16).astype(np.float32)

    weights: dict[str, tuple[np.ndarray, QT]] = {}
    gguf_tensors: list[tuple[str, np.ndarray, QT]] = []

    def add(hf: str, gguf_name: str, w: np.ndarray, qtype: QT, n_head: int = 0) -> None:
        weights[hf] = (w, qtype)
        stored = llama_cpp_permute(w, n_head) if arch == "llama" and n_head else w
        gguf_tensors.append((gguf_name, stored, qtype))

    add("model.embed_tokens.weight", "token_embd.weight", rand(VOCAB, HIDDEN), QT.Q8_0)
    shapes = {
        "q": (HEADS * head_dim, HIDDEN),
        "k": (KV_HEADS * head_dim, HIDDEN),
        "v": (KV_HEADS * head_dim, HIDDEN),
        "o": (HIDDEN, HEADS * head_dim),
        "gate": (INTER, HIDDEN),
        "up": (INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }
    heads = {"q": HEADS, "k": KV_HEADS}
    for i, qtypes in enumerate(LAYER_QTYPES):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        add(pre + "input_layernorm.weight", blk + "attn_norm.weight", rand(HIDDEN), QT.F32)
        add(pre + "post_attention_layernorm.weight", blk + "ffn_norm.weight", rand(HIDDEN), QT.F32)
        for proj, qtype in qtypes.items():
            hf, gg = pre + PROJ_HF[proj], blk + PROJ_GGUF[proj]
            add(hf + ".weight", gg + ".weight", rand(*shapes[proj]), qtype, heads.get(proj, 0))
            if arch == "qwen2" and proj in ("q", "k", "v"):
                add(hf + ".bias", gg + ".bias", rand(shapes[proj][0]), QT.F32)
        if arch == "qwen3":
            add(pre + "self_attn.q_norm.weight", blk + "attn_q_norm.weight", rand(head_dim), QT.F32)
            add(pre + "self_attn.k_norm.weight", blk + "attn_k_norm.weight", rand(head_dim), QT.F32)
    add("model.norm.weight", "output_norm.weight", rand(HIDDEN), QT.F32)
    if not tie:
        add("lm_head.weight", "output.weight", rand(VOCAB, HIDDEN), QT.Q4_1)

    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if eot is not None:
        writer.add_eot_token_id(eot)
        writer.add_eom_token_id(2)  # the same as eos: once
    if yarn:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
    if rope_freqs is not None:  # (llama.cpp's form of Llama 3's rope scaling)
        gguf_tensors.append(("rope_freqs.weight", rope_freqs.astype(np.float32), QT.F32))
    for name, w, qtype in gguf_tensors:
        raw_dtype = None if qtype in (QT.F32, QT.F16) else qtype
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def hf_config_value(hf_config: Any, key: str) -> Any:
    if key == "rope_theta" and getattr(hf_config, "rope_parameters", None):
        return hf_config.rope_parameters["rope_theta"]  # transformers >= 5
    return getattr(hf_config, key)


def assert_config_matches_transformers(ours: dict[str, Any], hf_config: Any) -> None:
    assert ours["model_type"] == hf_config.model_type
    assert ours["architectures"][0].lower().startswith(hf_config.model_type)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == hf_config_value(hf_config, key), key
    for key in ("rms_norm_eps", "rope_theta"):
        assert ours[key] == pytest.approx(hf_config_value(hf_config, key), rel=1e-6), key
    hf_head_dim = (
        getattr(hf_config, "head_dim", None) or ours["hidden_size"] // ours["num_attention_heads"]
    )
    assert ours["head_dim"] == hf_head_dim


def assert_weights_match_transformers(
    ours: dict[str, torch.Tensor], model: torch.nn.Module
) -> None:
    state = model.state_dict()
    expected_names = set(state)
    if model.config.tie_word_embeddings:
        expected_names.discard("lm_head.weight")  # tied: we yield only the embedding
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=0, msg=name)


# qwen3 with head_dim 128 != hidden/heads: transformers' GGUF config has no head_dim mapping for
# qwen3 and falls back to Qwen3Config's default of 128, so only that value can be compared.
@pytest.mark.parametrize(
    "arch, tie, head_dim", [("llama", False, 16), ("qwen2", True, 16), ("qwen3", False, 128)]
)
def test_tiny_gguf_weights_round_trip(tmp_path: Path, arch: str, tie: bool, head_dim: int) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    originals = write_tiny_gguf(path, arch, tie, head_dim)
    ours = dict(iter_gguf_weights(str(path), show_progress=False))

    assert set(ours) == set(originals)
    for name, (original, qtype) in originals.items():
        got = ours[name].numpy()
        assert got.shape == original.shape, name
        tolerance = QUANT_ERROR[qtype] * np.abs(original).max()
        # exact for F32/F16: this is where a wrong q/k un-permutation would show
        np.testing.assert_allclose(got, original, rtol=0, atol=tolerance, err_msg=name)

    config = gguf_to_hf_config(str(path))
    assert config["tie_word_embeddings"] is tie
    assert config["attention_bias"] is (arch == "qwen2")
    model = load_hf_reference(str(path))
    assert_config_matches_transformers(config, model.config)
    assert_weights_match_transformers(ours, model)


def test_llama3_rope_frequency_factors_are_applied(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1/3.2's rope scaling as rope_freqs.weight, a factor per
    frequency; it was skipped with a warning, and outputs differed from the original model.
    The factors convert_hf_to_gguf computes from a llama3 rope_scaling give the frequencies
    of that rope_scaling (ours for llama3 is checked against transformers elsewhere)."""
    from radixserve.layers.rotary_embedding import compute_inv_freq

    head_dim, theta = HIDDEN // HEADS, 50000.0
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for f in freqs:  # llama.cpp's convert_hf_to_gguf (LlamaModel.generate_extra_tensors)
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:
            factors.append(1.0)
        elif wavelen > 64 / 1.0:
            factors.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = tmp_path / "tiny-llama3.gguf"
    write_tiny_gguf(path, "llama", tie=True, rope_freqs=np.array(factors))
    config = ModelConfig.from_hf_config(gguf_to_hf_config(str(path)))
    assert config.rope_scaling["rope_type"] == "freq_factors"
    ours, _ = compute_inv_freq(head_dim, theta, config.rope_scaling, 256)
    want, _ = compute_inv_freq(head_dim, theta, llama3, 256)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=0)
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(str(path), show_progress=False))


def test_end_of_turn_tokens_end_generation_too(tmp_path: Path) -> None:
    """Llama 3's <|eot_id|> (tokenizer.ggml.eot_token_id) ends a chat reply; only eos did."""
    path = tmp_path / "tiny-eot.gguf"
    write_tiny_gguf(path, "llama", tie=True, eot=7)
    assert gguf_to_hf_config(str(path))["eos_token_id"] == [2, 7]
    assert ModelConfig.from_hf_config(gguf_to_hf_config(str(path))).eos_token_ids == (2, 7)


def test_tiny_gguf_config_fields(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen3.gguf"
    write_tiny_gguf(path, "qwen3", tie=True, head_dim=32, yarn=True)
    config = gguf_to_hf_config(str(path))
    assert config == {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": 32,  # from attention.key_length, not hidden_size // heads
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    q_proj = dict(iter_gguf_weights(str(path), show_progress=False))[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    assert q_proj.shape == (HEADS * 32, HIDDEN)


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "empty"])
def test_a_damaged_gguf_file_is_named_as_such(tmp_path: Path, damage: str) -> None:
    """A half-downloaded file failed with numpy's "cannot reshape array of size 1392", with
    neither the path nor a hint."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tie=True)
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "not_gguf": b"<html>" * 100, "empty": b""}[damage]
    )
    with pytest.raises(ValueError, match="tiny.gguf is not a readable GGUF file"):
        gguf_to_hf_config(str(path))


def test_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        gguf_to_hf_config(str(path))


def test_an_unsupported_architecture_is_refused_before_start(tmp_path: Path) -> None:
    """Found by the scheduler and the detokenizer (transformers' "GGUF model with architecture
    gemma is not supported yet" and a traceback each) after start-up: the serve command and
    the Engine read it from the header now."""
    from radixserve.model_loader.gguf_loader import read_gguf_header
    from radixserve.model_loader.loader import check_model_config

    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(str(path), "gemma")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc"])
    writer.add_uint32("gemma.block_count", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_header(str(path)).metadata["general.architecture"] == "gemma"
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        check_model_config(str(path), "auto", None)
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny, "qwen2", tie=True)
    assert read_gguf_header(str(tiny)).metadata["general.architecture"] == "qwen2"
    check_model_config(str(tiny), "auto", None)
    assert read_gguf_header(__file__) is None  # not a GGUF: the loader says what it is


def test_a_cut_short_gguf_and_heads_tp_cannot_split_are_refused_before_start(
    tmp_path: Path,
) -> None:
    """A GGUF whose download did not finish was found by the scheduler 40 s into the start-up
    (GGUFReader's "cannot reshape array of size ..."), and --tp-size against the heads only
    when the model was built: the header says both."""
    from radixserve.model_loader.gguf_loader import read_gguf_header
    from radixserve.model_loader.loader import check_model_config

    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny, "llama", tie=False)
    size = tiny.stat().st_size
    header = read_gguf_header(str(tiny))
    assert header is not None and header.size_needed == size  # (no padding after the last)
    assert header.metadata["llama.attention.head_count"] == HEADS
    check_model_config(str(tiny), "auto", None, tp_size=2)  # 4 heads, 2 KV heads: splits
    with pytest.raises(ValueError, match=f"{HEADS} attention heads, which --tp-size 3"):
        check_model_config(str(tiny), "auto", None, tp_size=3)
    with pytest.raises(ValueError, match="which --tp-size 3 does not divide"):
        check_model_config(str(tiny), "auto", 64, tp_size=3)  # (the full-config path too)
    with open(tiny, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(ValueError, match=f"cut short: {size - 1} bytes of the {size}"):
        check_model_config(str(tiny), "auto", None)
    # Cut inside the header (it holds the vocabulary: megabytes): a raw struct error and a
    # traceback from the loader, after the start-up.
    with open(tiny, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="cut short or damaged: its header cannot be read"):
        check_model_config(str(tiny), "auto", None)


def test_a_quant_type_the_gguf_package_cannot_read_is_refused_before_start(
    tmp_path: Path,
) -> None:
    """Q8_1 failed with NotImplementedError and a traceback after 10 s of loading."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from radixserve.model_loader.loader import check_model_config

    path = tmp_path / "q81.gguf"
    writer = GGUFWriter(str(path), "llama")
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    raw = np.zeros((4, 2 * block_bytes), dtype=np.uint8)  # 4 rows of 2 blocks
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="quant type Q8_1, which the installed gguf package"):
        check_model_config(str(path), "auto", None)


def test_heads_tp_cannot_split_are_refused_before_start_for_a_directory(tmp_path: Path) -> None:
    from rs_testing import make_tiny_model_dir

    from radixserve.model_loader.loader import check_model_config

    model = make_tiny_model_dir(str(tmp_path / "m"))
    heads = json.loads((Path(model) / "config.json").read_text())["num_attention_heads"]
    with pytest.raises(ValueError, match=f"{heads} attention heads, which --tp-size {heads + 1}"):
        check_model_config(model, "auto", None, tp_size=heads + 1)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_to_hf_config(str(tmp_path / "nope.gguf"))


# --- the real default model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding) ---


@pytest.mark.real_model
def test_default_model_matches_transformers(default_gguf: str) -> None:
    reader = open_gguf(default_gguf)  # parsed once: the 49k-token vocabulary takes seconds
    config = gguf_to_hf_config(reader)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    model = load_hf_reference(default_gguf)  # the session's transformers load, shared
    assert_config_matches_transformers(config, model.config)
    ours = dict(iter_gguf_weights(reader, show_progress=False))
    assert "lm_head.weight" not in ours
    assert_weights_match_transformers(ours, model)


@pytest.mark.real_model
def test_default_tokenizer_round_trips_and_has_chat_template(
    default_gguf: str, default_tokenizer: Any
) -> None:
    config = gguf_to_hf_config(default_gguf)
    assert default_tokenizer.eos_token_id == config["eos_token_id"]
    assert len(default_tokenizer) == config["vocab_size"]
    text = "Hello, world! Radix trees share prefixes."
    assert default_tokenizer.decode(default_tokenizer.encode(text)) == text
    prompt = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.real_model
def test_chat_template_is_taken_from_metadata_when_transformers_drops_it(
    default_gguf: str, default_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    import transformers

    bare = copy.deepcopy(default_tokenizer)
    bare.chat_template = None
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: bare)
    tokenizer = load_gguf_tokenizer(default_gguf)
    assert tokenizer.chat_template == default_tokenizer.chat_template
    assert "<|im_start|>" in tokenizer.chat_template
