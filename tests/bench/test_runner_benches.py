"""The benchmarks that drive ModelRunner in-process (`bench one-batch`, `bench perplexity`, the
pure step of `bench overhead`) on a tiny random model: KV pools sized in whole pages, and
statistics of nothing measured written as JSON null, not bare NaN."""

from __future__ import annotations

import json
import math

import pytest
from rs_testing import make_tiny_served_model

from radixserve.bench import kv_pool_tokens, one_batch, perplexity


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_served_model(str(tmp_path_factory.mktemp("tiny")))


def _strict_json(line: str) -> dict:
    """json.loads that refuses NaN / Infinity (which jq and JSON.parse reject)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"invalid JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize(
    "requests, tokens, page, expected",
    [(1, 20, 1, 20), (3, 24, 16, 96), (2, 32, 16, 64), (1, 58, 16, 64)],
)
def test_kv_pool_tokens_are_whole_pages_per_request(requests, tokens, page, expected):
    assert kv_pool_tokens(requests, tokens, page) == expected


def test_one_batch_runs_with_pages_larger_than_one(tiny, tmp_path):
    """The pool was sized in raw tokens (3 x 24 = 72), rounded down to 64 = 4 pages, and 3
    requests of 2 pages each ended in "MemoryError: KV pool exhausted"."""
    out = tmp_path / "ob.jsonl"
    results = one_batch.main(
        ["--model-path", tiny, "--device", "cpu", "--dtype", "float32", "--page-size", "16",
         "--batch-size", "1", "3", "--input-len", "20", "--output-len", "4",
         "--output-file", str(out)]
    )  # fmt: skip
    assert [r["batch_size"] for r in results] == [1, 3]
    assert all(r["median_decode_latency_s"] > 0 for r in results)
    assert len(out.read_text().splitlines()) == 2


def test_one_batch_with_one_output_token_reports_no_decode_stats(tiny, tmp_path, capsys):
    """No decode step: the median was NaN, printed as "nan" and written as bare NaN."""
    out = tmp_path / "ob.jsonl"
    (result,) = one_batch.main(
        ["--model-path", tiny, "--device", "cpu", "--dtype", "float32", "--batch-size", "2",
         "--input-len", "7", "--output-len", "1", "--warmup", "0", "--output-file", str(out)]
    )  # fmt: skip
    assert result["median_decode_latency_s"] is None
    assert result["median_decode_throughput"] is None
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.split()[-2:] == ["n/a", "n/a"] and "nan" not in row
    written = _strict_json(out.read_text())
    assert written["median_decode_latency_s"] is None and written["prefill_latency_s"] > 0


def test_perplexity_runs_with_pages_larger_than_one(tiny, tmp_path):
    """The pool was window + 8 = 58 tokens, rounded down to 48 (3 pages): a 50-token window
    needs 4."""
    out = tmp_path / "ppl.jsonl"
    result = perplexity.main(
        ["--model-path", tiny, "--device", "cpu", "--dtype", "float32", "--page-size", "16",
         "--window", "50", "--max-tokens", "120", "--output-file", str(out)]
    )  # fmt: skip
    assert (
        result["tokens"] == 117
    )  # windows of 50, 50 and 20 tokens and math.isfinite(result["perplexity"])
    assert _strict_json(out.read_text())["perplexity"] == result["perplexity"]


def test_a_nan_perplexity_is_written_as_null(tiny, tmp_path, monkeypatch):
    """A broken model (NaN logits) is what the check is for: its line must still be JSON."""
    monkeypatch.setattr(perplexity, "score", lambda runner, ids, window: (math.nan, 10))
    out = tmp_path / "ppl.jsonl"
    result = perplexity.main(
        ["--model-path", tiny, "--device", "cpu", "--window", "16", "--max-tokens", "40",
         "--output-file", str(out)]
    )  # fmt: skip
    assert math.isnan(result["perplexity"])
    written = _strict_json(out.read_text())
    assert written["mean_nll"] is None and written["perplexity"] is None


def test_overheads_pure_step_runs_with_pages_larger_than_one(tiny):
    """Its pool was input + output + 8 = 34 tokens, rounded down to 32: the request's third
    page was missing."""
    from radixserve.args import ServerArgs
    from radixserve.bench.overhead import pure_step_args
    from radixserve.model_executor.model_runner import ModelRunner

    base = ServerArgs(model_path=tiny, device="cpu", dtype="float32", page_size=16).resolve()
    runner = ModelRunner(pure_step_args(base, 20, 6))
    result = one_batch.run_case(runner, 1, 20, 6)
    assert result["median_decode_latency_s"] > 0


def test_perplexity_and_offline_refuse_bad_inputs_before_loading_a_model(tmp_path, monkeypatch):
    """perplexity of a directory without config.json said that sentencepiece or tiktoken was
    missing; offline read its --dataset-path only once the Engine had loaded the model."""
    from radixserve.bench import offline

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        perplexity.main(["--model-path", str(empty), "--device", "cpu"])

    def no_engine(*args, **kwargs):
        raise AssertionError("the model was loaded before the dataset was read")

    monkeypatch.setattr("radixserve.entrypoints.engine.Engine", no_engine)
    tiny = make_tiny_served_model(str(tmp_path / "tiny"))
    with pytest.raises((ValueError, OSError), match="nope.json"):
        offline.main(
            ["--model-path", tiny, "--device", "cpu", "--dataset-name", "sharegpt",
             "--dataset-path", str(tmp_path / "nope.json"), "--num-prompts", "2"]
        )  # fmt: skip
