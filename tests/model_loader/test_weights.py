"""Hugging Face directories: weight iteration (safetensors, index, .bin fallback), config, tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from radixserve.model_loader import weights
from radixserve.model_loader.weights import (
    iter_safetensors_weights,
    load_hf_config,
    load_tokenizer,
)


def _tensors(prefix: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(prefix))
    return {f"{prefix}.{i}.weight": torch.randn(3, 4, generator=gen) for i in range(2)}


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_all_safetensors_shards_are_read(tmp_path: Path) -> None:
    a, b = _tensors("model.layers"), _tensors("lm_head")
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    _assert_same(dict(iter_safetensors_weights(str(tmp_path))), a | b)


def test_index_limits_the_shards(tmp_path: Path) -> None:
    a = _tensors("model.layers")
    save_file(a, tmp_path / "model-00001-of-00001.safetensors")
    save_file(_tensors("stray"), tmp_path / "consolidated.safetensors")
    index = {"weight_map": dict.fromkeys(a, "model-00001-of-00001.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_same(dict(iter_safetensors_weights(str(tmp_path))), a)


def test_pytorch_bin_fallback(tmp_path: Path) -> None:
    a = _tensors("model.layers")
    torch.save(a, tmp_path / "pytorch_model.bin")
    _assert_same(dict(iter_safetensors_weights(str(tmp_path))), a)


def test_missing_files_raise_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(iter_safetensors_weights(str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="absent"):
        load_tokenizer(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_tokenizer(str(tmp_path), gguf_file="absent.gguf")


def test_load_hf_config(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(str(tmp_path)) == config


@pytest.mark.parametrize(
    "config_eos,generation_eos,eos",
    [
        (128001, [128001, 128009], [128001, 128009]),
        ([2], 7, [2, 7]),
        (None, 5, [5]),
        (3, None, [3]),
    ],
)
def test_the_generation_configs_eos_tokens_end_generation_too(
    tmp_path: Path, config_eos: Any, generation_eos: Any, eos: list[int]
) -> None:
    """Llama 3 Instruct's config.json names <|end_of_text|>; its generation_config.json adds
    <|eot_id|>, which ends each chat reply (transformers' generate stops there; we did not)."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": config_eos}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert load_hf_config(str(tmp_path))["eos_token_id"] == eos


def test_load_tokenizer_sends_gguf_paths_to_the_gguf_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(weights, "load_gguf_tokenizer", lambda path: calls.append(path) or path)
    load_tokenizer(str(tmp_path / "m.gguf"))
    load_tokenizer(str(tmp_path), gguf_file="m.gguf")
    assert calls == [str(tmp_path / "m.gguf")] * 2
    # Named otherwise (--load-format gguf serves it): found by its magic; the server died
    # after loading the weights ("expected a directory or .gguf"), --tokenizer-path refused it.
    (tmp_path / "model.bin").write_bytes(b"GGUF" + bytes(60))
    load_tokenizer(str(tmp_path / "model.bin"))
    assert calls[-1] == str(tmp_path / "model.bin")
    from radixserve.model_loader.loader import check_model_path

    check_model_path(str(tmp_path / "model.bin"), "--tokenizer-path")
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04")
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a directory"):
        check_model_path(str(tmp_path / "other.bin"), "--tokenizer-path")


@pytest.mark.real_model
def test_load_tokenizer_from_hf_directory(default_tokenizer: Any, tmp_path: Path) -> None:
    default_tokenizer.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    text = "a radix tree"
    assert tokenizer.encode(text) == default_tokenizer.encode(text)
    assert tokenizer.chat_template == default_tokenizer.chat_template


@pytest.mark.parametrize("broken", ["missing_k_proj", "missing_up_proj", "more_kv_heads"])
def test_a_checkpoint_short_of_a_fused_part_is_refused(tmp_path: Path, broken: str) -> None:
    """A checkpoint without layer 0's k_proj (or with fewer key/value heads than its config
    says) loaded without a word: the fused qkv / gate_up rows it lacked kept their random
    initial values, and the model served tokens from them."""
    from rs_testing import make_tiny_model_dir
    from safetensors.torch import load_file

    from radixserve.model_loader.loader import load_model

    path = str(tmp_path / "m")
    make_tiny_model_dir(path, "llama")
    tensors = load_file(f"{path}/model.safetensors")
    if broken == "more_kv_heads":
        config = json.loads(Path(path, "config.json").read_text())
        assert config["num_attention_heads"] >= 2 * config["num_key_value_heads"]
        config["num_key_value_heads"] *= 2
        Path(path, "config.json").write_text(json.dumps(config))
        match = "k_proj.weight: shape \\(32, 64\\) != \\(64, 64\\)"
    else:
        part = {"missing_k_proj": "self_attn.k_proj", "missing_up_proj": "mlp.up_proj"}[broken]
        del tensors[f"model.layers.0.{part}.weight"]
        save_file(tensors, f"{path}/model.safetensors")
        match = f"missing 1 tensors, e.g. \\['model.layers.0.{part}.weight'\\]"
    with pytest.raises(ValueError, match=match):
        load_model(path, "safetensors", "float32", "cpu")


def test_tokenizers_with_their_own_code_a_damaged_one_and_exported_copies(tmp_path, monkeypatch):
    """--trust-remote-code never reached AutoTokenizer (a model with its own tokenizer class
    could not be served); a damaged tokenizer.json was named by nothing but its JSON error;
    two GGUF files of one name shared one exported tokenizer copy (the second server
    reported the first model's tokenizer and chat template)."""
    from rs_testing import make_tiny_served_model

    from radixserve.args import ServerArgs
    from radixserve.managers.tokenizer_utils import exported_tokenizer_dir, load_tokenizer_for
    from radixserve.model_loader.weights import load_tokenizer

    model = make_tiny_served_model(str(tmp_path / "custom"))
    with open(os.path.join(model, "own_tokenizer.py"), "w") as f:
        f.write("from transformers import PreTrainedTokenizerFast\n\n\n")
        f.write("class OwnTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config_path = os.path.join(model, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "OwnTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "own_tokenizer.OwnTokenizer"]}
    with open(config_path, "w") as f:
        json.dump(config, f)
    args = ServerArgs(model_path=model, trust_remote_code=True)
    assert type(load_tokenizer_for(args)).__name__ == "OwnTokenizer"
    with pytest.raises(
        ValueError, match="cannot load the tokenizer from .* \\(--trust-remote-code runs it\\)"
    ):
        load_tokenizer_for(ServerArgs(model_path=model))

    with open(os.path.join(model, "tokenizer.json"), "r+") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"cannot load the tokenizer from {model}"):
        load_tokenizer(model)

    class Saved:
        def __init__(self, marker: str) -> None:
            self.marker = marker

        def save_pretrained(self, path: str) -> None:
            with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
                f.write(self.marker)

    monkeypatch.setenv("RADIXSERVE_MODEL_CACHE", str(tmp_path / "cache" / "models"))
    dirs = []
    for name in ("a", "b"):
        gguf = tmp_path / name / "ggml-model-Q4_1.gguf"
        gguf.parent.mkdir()
        gguf.write_bytes(b"GGUF" + name.encode())
        dirs.append(exported_tokenizer_dir(ServerArgs(model_path=str(gguf)), Saved(name)))
    assert dirs[0] != dirs[1]
    assert [open(os.path.join(d, "tokenizer_config.json")).read() for d in dirs] == ["a", "b"]
