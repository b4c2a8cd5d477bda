"""Request generators of `radixserve.bench.datasets`, on tiny in-memory tokenizers."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from radixserve.bench.datasets import (
    GSP_SEPARATOR,
    BenchRequest,
    model_source,
    sample_generated_shared_prefix_requests,
    sample_natural_requests,
    sample_random_requests,
    sample_rewrite_requests,
    sample_sharegpt_requests,
)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- random


def test_random_token_ids_respect_lengths_and_skip_special_tokens(word_tokenizer):
    reqs = sample_random_requests(word_tokenizer, 200, 40, 20, 0.25, seed=7, return_text=False)
    assert len(reqs) == 200
    special = set(word_tokenizer.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, list) and r.prompt_len == len(r.prompt)
        assert 10 <= r.prompt_len <= 40 and 5 <= r.output_len <= 20
        assert not special.intersection(r.prompt)
        assert all(0 <= t < word_tokenizer.vocab_size for t in r.prompt)
    # Uniform over the range: both ends are reachable.
    assert min(r.prompt_len for r in reqs) < 15 and max(r.prompt_len for r in reqs) > 35


def test_random_text_reports_length_after_retokenization(bpe_tokenizer):
    reqs = sample_random_requests(bpe_tokenizer, 30, 64, 8, 1.0, seed=3)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(bpe_tokenizer.encode(r.prompt))
        assert r.output_len == 8
    # Re-tokenizing random byte-level tokens changes counts; the generator steers close to 64.
    assert sum(abs(r.prompt_len - 64) <= 2 for r in reqs) >= 27


def test_random_text_is_exact_for_a_lossless_tokenizer(word_tokenizer):
    reqs = sample_random_requests(word_tokenizer, 10, 16, 4, 1.0, seed=1)
    assert all(r.prompt_len == 16 == len(word_tokenizer.encode(r.prompt)) for r in reqs)


def test_random_is_deterministic_by_seed(bpe_tokenizer):
    a = sample_random_requests(bpe_tokenizer, 8, 32, 16, 0.5, seed=11)
    b = sample_random_requests(bpe_tokenizer, 8, 32, 16, 0.5, seed=11)
    c = sample_random_requests(bpe_tokenizer, 8, 32, 16, 0.5, seed=12)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


# ------------------------------------------------------ generated-shared-prefix


def _gsp(tok, **kw):
    args = dict(num_groups=4, prompts_per_group=5, system_prompt_len=24, question_len=6)
    args.update(kw)
    return sample_generated_shared_prefix_requests(tok, output_len=9, **args)


def test_gsp_groups_share_their_own_prefix_token_ids(word_tokenizer):
    reqs = _gsp(word_tokenizer, return_text=False)
    assert len(reqs) == 20
    assert all(r.prompt_len == len(r.prompt) == 30 and r.output_len == 9 for r in reqs)
    groups = Counter(tuple(r.prompt[:24]) for r in reqs)
    # Exactly num_groups distinct prefixes, each used by prompts_per_group prompts ...
    assert sorted(groups.values()) == [5, 5, 5, 5]
    # ... and the questions after the prefix are distinct.
    assert len({tuple(r.prompt[24:]) for r in reqs}) == 20


def test_gsp_text_prompts_share_prefix_tokens(word_tokenizer, bpe_tokenizer):
    for tok in (word_tokenizer, bpe_tokenizer):
        reqs = _gsp(tok, shuffle=False)
        for g in range(4):
            group = reqs[g * 5 : (g + 1) * 5]
            prefix_text = group[0].prompt.split(GSP_SEPARATOR)[0]
            assert all(r.prompt.startswith(prefix_text + GSP_SEPARATOR) for r in group)
            ids = [tok.encode(r.prompt) for r in group]
            assert all(r.prompt_len == len(i) for r, i in zip(group, ids, strict=True))
            shared = min(_common_prefix_len(ids[0], other) for other in ids[1:])
            assert shared >= len(tok.encode(prefix_text)) - 1
        # Different groups do not share their prefix.
        first = [tok.encode(reqs[g * 5].prompt) for g in range(4)]
        assert max(_common_prefix_len(first[0], f) for f in first[1:]) < 12


def test_gsp_is_shuffled_by_seed(word_tokenizer):
    def group_order(reqs: list[BenchRequest]) -> list[tuple[int, ...]]:
        return [tuple(r.prompt[:24]) for r in reqs]

    ordered = group_order(_gsp(word_tokenizer, return_text=False, shuffle=False, seed=5))
    assert ordered == sorted(ordered, key=ordered.index)  # contiguous blocks of 5
    shuffled = _gsp(word_tokenizer, return_text=False, seed=5)
    assert group_order(shuffled) != ordered
    assert sorted(group_order(shuffled)) == sorted(ordered)
    assert shuffled == _gsp(word_tokenizer, return_text=False, seed=5)


# --------------------------------------------------------------- sharegpt


def _conv(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def _words(n: int, start: int = 0) -> str:
    return " ".join(f"w{(start + i) % 90}" for i in range(n))


@pytest.fixture
def sharegpt_file(tmp_path):
    data = [
        _conv(("human", _words(6)), ("gpt", _words(10))),  # kept: 6 in, 10 out
        _conv(("human", _words(3)), ("gpt", _words(10))),  # prompt too short
        _conv(("human", _words(8)), ("gpt", _words(2))),  # reply too short
        _conv(("human", _words(5))),  # no reply
        _conv(("gpt", _words(9)), ("human", _words(7)), ("gpt", _words(12))),  # 7 in, 12 out
        {"conversation": _conv(("human", _words(20)), ("gpt", _words(30)))["conversations"]},
        _conv(("human", _words(1100)), ("gpt", _words(10))),  # prompt over 1024
        _conv(("human", _words(1000)), ("gpt", _words(1100))),  # total over 2048
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_parses_and_filters(word_tokenizer, sharegpt_file):
    reqs = sample_sharegpt_requests(word_tokenizer, sharegpt_file, 100, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(6, 10), (7, 12), (20, 30)]
    for r in reqs:
        assert r.prompt_len == len(word_tokenizer.encode(r.prompt))


def test_sharegpt_entries_of_another_shape_are_skipped_or_named(word_tokenizer, tmp_path):
    """A turn without "value" was a KeyError traceback, a list of numbers or a top-level
    object an AttributeError."""
    data = [
        1,
        {"conversations": "none"},
        _conv(("human", _words(6)), ("gpt", _words(10))),
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}, 3]},
    ]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(data))
    reqs = sample_sharegpt_requests(word_tokenizer, str(path), 100, seed=0)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(6, 10)]
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="is not a ShareGPT file: a JSON list"):
        sample_sharegpt_requests(word_tokenizer, str(path), 100, seed=0)


def test_sharegpt_fixed_output_len_context_len_and_limit(word_tokenizer, sharegpt_file):
    fixed = sample_sharegpt_requests(word_tokenizer, sharegpt_file, 100, fixed_output_len=5)
    # The 2-token reply no longer disqualifies its prompt once the output length is fixed.
    assert sorted(r.prompt_len for r in fixed) == [6, 7, 8, 20, 1000]
    assert all(r.output_len == 5 for r in fixed)
    ctx = sample_sharegpt_requests(word_tokenizer, sharegpt_file, 100, context_len=20)
    assert sorted((r.prompt_len, r.output_len) for r in ctx) == [(6, 10), (7, 12)]
    assert len(sample_sharegpt_requests(word_tokenizer, sharegpt_file, 2)) == 2
    with pytest.raises(ValueError):
        sample_sharegpt_requests(word_tokenizer, sharegpt_file, 10, fixed_output_len=2)


def test_sharegpt_order_is_deterministic_by_seed(word_tokenizer, sharegpt_file):
    def order(seed: int) -> tuple[int, ...]:
        reqs = sample_sharegpt_requests(word_tokenizer, sharegpt_file, 10, seed=seed)
        return tuple(r.prompt_len for r in reqs)

    assert order(0) == order(0)
    assert len({order(seed) for seed in range(6)}) > 1
    ids = sample_sharegpt_requests(word_tokenizer, sharegpt_file, 10, return_text=False)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len for r in ids)


def test_model_source_splits_gguf_paths(tmp_path):
    gguf = tmp_path / "m.Q4_1.gguf"
    assert model_source(str(gguf)) == (str(tmp_path), {"gguf_file": "m.Q4_1.gguf"})
    assert model_source(str(tmp_path)) == (str(tmp_path), {})


# ---------------------------------------------------------------- rewrite / natural


def test_rewrite_prompts_quote_a_documentation_passage(bpe_tokenizer):
    from pydoc_data.topics import topics

    reqs = sample_rewrite_requests(bpe_tokenizer, 6, 40, 64, seed=3)
    assert len(reqs) == 6 and all(r.output_len == 64 for r in reqs)
    for r in reqs:
        assert r.prompt.startswith("Repeat the following text exactly")
        passage = r.prompt.split("\n\n", 1)[1].strip()
        words = passage.split()
        assert len(words) >= 5
        # The passage is a piece of one topic's text (as decoded by the tokenizer).
        assert any(" ".join(words[1:4]) in " ".join(t.split()) for t in topics.values())
        assert r.prompt_len == len(bpe_tokenizer.encode(r.prompt))
    again = sample_rewrite_requests(bpe_tokenizer, 6, 40, 64, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert [r.prompt for r in sample_rewrite_requests(bpe_tokenizer, 6, 40, 64, seed=4)] != [
        r.prompt for r in reqs
    ]


def test_natural_prompts_ask_about_a_topic(bpe_tokenizer):
    reqs = sample_natural_requests(bpe_tokenizer, 20, 32, seed=1)
    assert len({r.prompt for r in reqs}) > 10
    assert all("Python" in r.prompt and r.output_len == 32 for r in reqs)


@pytest.mark.parametrize("name", ["natural", "rewrite"])
def test_chat_datasets_give_token_ids_when_asked(bpe_tokenizer, name):
    """--tokenize-prompt (and bench offline, whose Engine takes only ids) got text for these
    two: offline sent each prompt as a list of its characters and every run failed."""
    import argparse

    from radixserve.bench.datasets import add_dataset_args, build_dataset

    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    args = parser.parse_args(["--dataset-name", name, "--num-prompts", "3", "--tokenize-prompt"])
    args.seed = 1  # (a flag of each tool's own)
    reqs = build_dataset(args, bpe_tokenizer)
    assert len(reqs) == 3
    for r in reqs:
        assert isinstance(r.prompt, list) and all(isinstance(t, int) for t in r.prompt)
        assert r.prompt_len == len(r.prompt) > 0
