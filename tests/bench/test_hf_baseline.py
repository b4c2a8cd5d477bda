"""The transformers baseline (`radixserve.bench.hf_baseline`) on a tiny random Llama saved locally."""

from __future__ import annotations

import json

import pytest

from radixserve.bench import hf_baseline

torch = pytest.importorskip("torch")


def test_left_pad_right_aligns_rows():
    ids, mask = hf_baseline.left_pad([[1, 2, 3], [4]], pad_id=0, device="cpu")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_physical_cores_is_positive():
    assert hf_baseline.physical_cores() >= 1


def test_main_runs_static_batches(word_tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(word_tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    word_tokenizer.save_pretrained(model_dir)
    out = tmp_path / "hf.jsonl"
    argv = [
        "--model-path", str(model_dir), "--num-prompts", "3", "--batch-size", "2",
        "--random-input-len", "6", "--random-output-len", "4", "--random-range-ratio", "0.5",
        "--threads", "1", "--device", "cpu", "--output-file", str(out),
    ]  # fmt: skip
    result = hf_baseline.main(argv)
    # 3 prompts in batches of 2 and 1; only the requested tokens of each row count.
    assert result["completed"] == 3 and result["num_batches"] == 2
    assert 3 <= result["total_input_tokens"] <= 18
    assert 3 * 2 <= result["total_output_tokens"] <= 3 * 4
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"]
    )
    assert result["mean_batch_latency_ms"] == pytest.approx(1000 * result["duration"] / 2)
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["backend"] == "hf-transformers"
