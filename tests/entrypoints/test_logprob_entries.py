"""OpenAI logprob entries: a token that holds part of a character (an emoji is four tokens of a
byte-level vocabulary) reports its own bytes, not those of the U+FFFD it decodes to alone; a
token the grammar forbids (-inf) is reported as -9999.0, OpenAI's number, never null."""

from __future__ import annotations

import json

import pytest
from rs_testing import make_sentencepiece_tokenizer, save_byte_tokenizer

from radixserve.entrypoints.openai_api import chat_logprobs, completion_logprobs
from radixserve.managers.tokenizer_utils import TokenStrings

TEXT = "a😀é 日本"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("byte_tokenizer"))
    save_byte_tokenizer(path, 320)
    return TokenStrings(AutoTokenizer.from_pretrained(path))


def _meta(ids):
    return {
        "output_token_logprobs": [(-0.5, i, None) for i in ids],
        "output_top_logprobs": [[(-0.5, i, None), (float("-inf"), 7, None)] for i in ids],
    }


def test_chat_entries_carry_each_tokens_own_bytes(tokens):
    ids = tokens.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT.encode())  # one token a byte
    out = chat_logprobs(tokens, _meta(ids), 0)
    assert [b for e in out.content for b in e.bytes] == list(TEXT.encode())
    assert [t.bytes for e in out.content for t in e.top_logprobs[:1]] == [
        e.bytes for e in out.content
    ]
    assert {t.logprob for e in out.content for t in e.top_logprobs[1:]} == {-9999.0}
    assert "null" not in json.dumps(out.model_dump()["content"])


def test_completion_entries_report_forbidden_tokens_as_numbers(tokens):
    ids = tokens.tokenizer.encode("ab", add_special_tokens=False)
    meta = _meta(ids)
    meta["output_token_logprobs"][1] = (float("-inf"), ids[1], None)
    out = completion_logprobs(tokens, meta, 0, 0)
    assert out.token_logprobs == [-0.5, -9999.0]
    assert all(-9999.0 in top.values() for top in out.top_logprobs)


def test_sentencepiece_entries_keep_the_spaces_in_their_bytes():
    """A SentencePiece token decoded alone loses its leading space ('▁fox' reads 'fox', '▁'
    reads ''): the bytes a client joins into the text read 'abcthe quickfox'."""
    tokens = TokenStrings(make_sentencepiece_tokenizer())
    text = "abc the quick fox"
    ids = tokens.tokenizer.encode(text, add_special_tokens=False)
    pieces = tokens.tokenizer.convert_ids_to_tokens(ids)
    assert any(p.startswith("▁") and len(p) > 1 for p in pieces) and "▁" in pieces
    out = chat_logprobs(tokens, _meta(ids), 0)
    assert bytes(b for e in out.content for b in e.bytes).decode() == " " + text
