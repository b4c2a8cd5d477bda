"""Stop strings end a request at the token that completes them, whatever the tokens per
character: an emoji is four tokens of a byte-level vocabulary (three of SmolLM2's), and the
tail decoded for the match must span the string's bytes, not its characters."""

from __future__ import annotations

import pytest
from rs_testing import save_byte_tokenizer

from radixserve.managers.schedule_batch import Req, finish_stop
from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("byte_tokenizer"))
    save_byte_tokenizer(path, 320)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("stop", ["😀", "日本", "é", "x😀y", "end", ["zz", "👍"]])
def test_a_stop_string_ends_the_request_at_its_last_token(byte_tokenizer, stop):
    first = stop if isinstance(stop, str) else stop[1]
    ids = byte_tokenizer.encode("hello, " + first, add_special_tokens=False)
    assert len(ids) == len(("hello, " + first).encode())  # one token a byte
    req = Req("r", [5], SamplingParams(stop=stop, max_new_tokens=100))
    for n in range(1, len(ids) + 1):  # token by token, as decode steps append them
        req.output_ids = ids[:n]
        req.check_finished(byte_tokenizer)
        if req.finished():
            break
    assert req.finished_reason == finish_stop(first)
    assert n == len(ids)
