"""Byte-fallback tokenizers (Llama 2, Mistral, Gemma: a character out of the vocabulary is its
UTF-8 bytes as <0xXX> tokens) decode a byte run that is not UTF-8 as a whole all U+FFFD, the
complete characters in it too. The scheduler's stop match and the detokenizer decode only
runs that start and end at a character's edge; SentencePiece logprob token text keeps the
word's leading space."""

from __future__ import annotations

import pytest
from rs_testing import make_sentencepiece_tokenizer, save_byte_tokenizer

from radixserve.entrypoints.openai_api import completion_logprobs
from radixserve.io_struct import BatchTokenIDOutput
from radixserve.managers.detokenizer_manager import DetokenizerManager
from radixserve.managers.schedule_batch import DECODE_CONTEXT, Req, finish_length, finish_stop
from radixserve.managers.tokenizer_utils import TokenStrings
from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    return make_sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("byte_tokenizer"))
    save_byte_tokenizer(path, 320)
    return AutoTokenizer.from_pretrained(path)


def _generate(tok, prompt: list[int], output: list[int], per_step: bool, **sp) -> tuple:
    """The text and finish reason of a request that samples `output` after `prompt`: each
    token checked by the scheduler's stop match as a decode step appends it, the tokens sent
    to the detokenizer one a step (streamed) or all at the finish."""
    params = SamplingParams(max_new_tokens=len(output), **sp)
    req = Req("r", prompt, params)
    detok = DetokenizerManager(tok)
    text, sent = "", 0
    for t in output:
        req.output_ids.append(t)
        req.check_finished(tok)
        if per_step or req.finished():
            out = BatchTokenIDOutput(
                ["r"],
                [req.finished_reason],
                [req.output_ids[sent:]],
                [True],
                [True],
                [False],
                [params.stop_strs],
                [len(prompt)],
                [len(req.output_ids)],
                [0],
            )
            out.decode_context = [prompt[-DECODE_CONTEXT:] if sent == 0 else []]
            sent = len(req.output_ids)
            text += detok.handle_batch_token_id_out(out).output_strs[0]
        if req.finished():
            break
    return text, req.finished_reason


@pytest.mark.parametrize("tokenizer", ["byte_fallback_tokenizer", "byte_tokenizer"])
@pytest.mark.parametrize("per_step", [True, False])
def test_an_output_after_a_prompt_whose_last_tokens_start_inside_a_character(
    request, tokenizer, per_step
):
    """The prompt's last 5 tokens (the output's decode context) began with the last bytes of
    the first '😀': the byte run they and the output's bytes made was not UTF-8, the output
    read '�� fox' for 'Ω fox', and a stop 'Ω' ran on to the length limit."""
    tok = request.getfixturevalue(tokenizer)
    prompt = tok.encode("abc 😀😀", add_special_tokens=False)
    output = tok.encode("abc 😀😀Ω fox", add_special_tokens=False)[len(prompt) :]
    assert tok.decode(prompt[-DECODE_CONTEXT:]).startswith("\ufffd")
    assert _generate(tok, prompt, output, per_step) == ("Ω fox", finish_length(len(output)))
    # (a stop in the output's first tokens: the whole output is decoded after the context)
    assert _generate(tok, prompt, output, per_step, stop="Ω") == ("", finish_stop("Ω"))


@pytest.mark.parametrize("per_step", [True, False])
def test_a_stop_completed_before_min_new_tokens_inside_a_byte_run_does_not_count(
    byte_fallback_tokenizer, per_step
):
    """'😀' is complete at token 5, before min_new_tokens (6); with 'Ω' after it the text
    before the newest token was decoded as one byte run, all U+FFFD, and '😀' read as the new
    token's: the request stopped at token 7 with the text cut to ' '."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("abc", add_special_tokens=False)
    output = tok.encode("😀Ω fox", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(output)[1:7] == [f"<0x{b:02X}>" for b in "😀Ω".encode()]
    got = _generate(tok, prompt, output, per_step, stop="😀", min_new_tokens=6)
    assert got == (" 😀Ω fox", finish_length(len(output)))


@pytest.mark.parametrize("per_step", [True, False])
def test_a_stop_repeated_after_min_new_tokens_inside_a_byte_run_is_cut_at_the_repeat(
    byte_fallback_tokenizer, per_step
):
    """The first 'é' is complete before min_new_tokens, the second ends the request: the
    non-streamed text was cut at the first (' '), the streamed one at the second (' é')."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("abc", add_special_tokens=False)
    output = tok.encode("éé fox", add_special_tokens=False)
    got = _generate(tok, prompt, output, per_step, stop="é", min_new_tokens=4)
    assert got == (" é", finish_stop("é"))


def test_sentencepiece_logprob_tokens_join_to_the_text(byte_fallback_tokenizer):
    """A SentencePiece token decoded alone loses its leading space: the legacy `tokens`
    read 'abc', 'the', 'quick' for 'abc the quick', and each text_offset after the first word
    pointed a character early. The echoed prompt's first token starts the text (no space)."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("abc the", add_special_tokens=False)
    output = tok.encode("abc the quick fox", add_special_tokens=False)[len(prompt) :]
    text = tok.decode(prompt + output)
    meta = {
        "input_token_logprobs": [(None, i, None) for i in prompt],
        "output_token_logprobs": [(-0.5, i, None) for i in output],
    }
    for echo, want in ((True, text), (False, text[len(tok.decode(prompt)) :])):
        out = completion_logprobs(TokenStrings(tok), meta, 0, 0, echo=echo)
        assert "".join(out.tokens) == want, echo
        assert [want[:o] for o in out.text_offset] == [
            "".join(out.tokens[:k]) for k in range(len(out.tokens))
        ], echo


def test_byte_level_logprob_token_text_is_unchanged(byte_tokenizer, default_tokenizer):
    """A byte-level BPE token's text (SmolLM2's, the default) is what it decodes to alone,
    U+FFFD for part of a character as before."""
    for tok in (byte_tokenizer, default_tokenizer):
        strings = TokenStrings(tok)
        assert all(strings(i) == tok.decode([i]) for i in range(len(tok)))


@pytest.mark.parametrize("per_step", [True, False])
def test_a_stop_before_min_new_tokens_in_a_token_that_begins_a_character(
    default_tokenizer, per_step
):
    """SmolLM2's 'Ġè' is a space and the first byte of '語': the text before the token that
    completes the character is not cut back to whole tokens ('Parent:'), where the ': ' that
    'Ġè' wrote before min_new_tokens would read as the new token's (and, first in the text,
    end the request in place of '語')."""
    tok = default_tokenizer
    output = tok.encode("Parent: 語 x")
    assert tok.convert_ids_to_tokens(output)[2:5] == ["Ġè", "ª", "ŀ"]
    got = _generate(tok, [198], output, per_step, stop=[": ", "語"], min_new_tokens=4)
    assert got == ("Parent: ", finish_stop("語"))
