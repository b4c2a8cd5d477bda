"""Stop strings end a request at the token that completes them, whatever the tokens per
character: an emoji is four tokens of a byte-level vocabulary (three of SmolLM2's), and the
tail decoded for the match must span the string's bytes, not its characters."""

from __future__ import annotations

import pytest
from rs_testing import make_sentencepiece_tokenizer, save_byte_tokenizer

from radixserve.managers.schedule_batch import Req, finish_stop
from radixserve.sampling_params import SamplingParams


def _run_to_stop(tok, prompt: list[int], ids: list[int], **sp) -> tuple[Req, int]:
    """A request fed `ids` a token a step, as decode steps append them, until it finishes (or
    they run out): it and how many it took."""
    req = Req("r", prompt, SamplingParams(**sp))
    for n in range(1, len(ids) + 1):
        req.output_ids = ids[:n]
        req.check_finished(tok)
        if req.finished():
            break
    return req, n


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
    req, n = _run_to_stop(byte_tokenizer, [5], ids, stop=stop, max_new_tokens=100)
    assert req.finished_reason == finish_stop(first)
    assert n == len(ids)


def _detokenize(tokenizer, ids: list[int], stop: str, per_step: bool) -> str:
    """The text the detokenizer gives for `ids` ending with a stop on `stop`: fed a token a
    step (streamed) or all at the end."""
    from radixserve.io_struct import BatchTokenIDOutput
    from radixserve.managers.detokenizer_manager import DetokenizerManager

    detok = DetokenizerManager(tokenizer)
    chunks = [[t] for t in ids] if per_step else [ids]
    text = ""
    for k, chunk in enumerate(chunks):
        reason = finish_stop(stop) if k == len(chunks) - 1 else None
        out = BatchTokenIDOutput(
            ["r"], [reason], [chunk], [True], [True], [False], [[stop]], [1], [1], [0]
        )
        text += detok.handle_batch_token_id_out(out).output_strs[0]
    return text


def test_a_stop_string_written_before_min_new_tokens_does_not_count_later(byte_tokenizer):
    """One written before min_new_tokens was reached stayed in the decoded tail: it ended the
    request at min_new_tokens, and the text was cut back before it (non-streamed: fewer
    characters than min_new_tokens tokens) or not at all (streamed, where it had been sent).
    Now the next one ends it (vLLM's rule), the text cut there either way."""
    ids = byte_tokenizer.encode("ab STOP cd STOP ef", add_special_tokens=False)
    req, n = _run_to_stop(
        byte_tokenizer, [5], ids, stop="STOP", min_new_tokens=9, max_new_tokens=100
    )
    assert req.finished_reason == finish_stop("STOP")
    assert n == len("ab STOP cd STOP")  # the second one, not at min_new_tokens (9)
    for per_step in (True, False):
        assert _detokenize(byte_tokenizer, ids[:n], "STOP", per_step) == "ab STOP cd "


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    return make_sentencepiece_tokenizer()


@pytest.mark.parametrize(
    "text, stop, upto",
    [("abc 日本語 ghi", "本", "abc 日本"), ("abc 😀😀 x", "😀 x", "abc 😀😀 x")],
)
def test_a_stop_string_of_byte_tokens_after_other_byte_tokens(
    byte_fallback_tokenizer, text, stop, upto
):
    """The tail decoded for the match started inside the character before the stop: the
    byte-fallback decoder made the whole byte run U+FFFD, the stop's characters too, and the
    stop was never matched (a Llama 2 / Mistral / Gemma model ran on past it)."""
    tok = byte_fallback_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert sum(p.startswith("<0x") for p in tok.convert_ids_to_tokens(ids)) >= 6
    req, n = _run_to_stop(tok, [5], ids, stop=stop, max_new_tokens=100)
    assert req.finished_reason == finish_stop(stop)
    assert tok.decode(ids[:n]) == upto


class PieceTokenizer:
    """Each id decodes to its piece (a multi-character piece completes two stops at once)."""

    PIECES = {1: "It", 2: " is", 3: " done", 4: '."', 5: " Then"}

    def decode(self, ids, **kw):
        return "".join(self.PIECES[i] for i in ids)


@pytest.mark.parametrize("stops", [['"', "."], [".", '"']])
def test_a_token_completing_two_stops_ends_at_the_first_in_the_text(stops):
    """Trimmed at the stop first in the list, the other (earlier in the text) stayed in the
    output: 'It is done.' for stop ['"', '.']."""
    tok = PieceTokenizer()
    req, n = _run_to_stop(tok, [5], [1, 2, 3, 4, 5], stop=stops, max_new_tokens=100)
    assert n == 4 and req.finished_reason == finish_stop(".")
    assert _detokenize(tok, [1, 2, 3, 4], ".", per_step=False) == "It is done"


class DoubledTokenizer:
    """Tokens that hold a stop string twice: SmolLM2's and Llama 3's "\n\n", "..."."""

    PIECES = {1: "Yes", 2: "\n\n", 3: " Well", 4: "...", 5: " ok", 6: "\n"}

    def decode(self, ids, **kw):
        return "".join(self.PIECES[i] for i in ids)


@pytest.mark.parametrize(
    "ids, stop, text",
    [([1, 2, 3], "\n", "Yes"), ([1, 3, 4, 5], ".", "Yes Well"), ([1, 3, 4], "..", "Yes Well")],
)
def test_a_token_holding_the_stop_twice_is_cut_at_the_first(ids, stop, text):
    """The request ends at the first occurrence in the token that completes the stop; the
    text was cut at the last ('Yes\n' for stop '\n' and the token '\n\n')."""
    tok = DoubledTokenizer()
    req, n = _run_to_stop(tok, [5], ids, stop=stop, max_new_tokens=100)
    assert req.finished_reason == finish_stop(stop)
    for per_step in (True, False):
        assert _detokenize(tok, ids[:n], stop, per_step) == text


def _detokenize_after(tok, prompt: list[int], output: list[int], per_step: bool) -> str:
    """The text the detokenizer gives for `output` after `prompt`, ended by length: fed a token
    a step (streamed) or all at the end."""
    from radixserve.io_struct import BatchTokenIDOutput
    from radixserve.managers.detokenizer_manager import DetokenizerManager

    detok = DetokenizerManager(tok)
    chunks = [[t] for t in output] if per_step else [output]
    text = ""
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        reason = {"type": "length", "length": len(output)} if last else None
        out = BatchTokenIDOutput(
            ["r"], [reason], [chunk], [True], [True], [False], [[]], [1], [1], [0]
        )
        out.decode_context = [prompt[-5:] if k == 0 else []]
        text += detok.handle_batch_token_id_out(out).output_strs[0]
    return text


def test_the_first_output_token_keeps_its_leading_space_after_the_prompt(
    byte_fallback_tokenizer,
):
    """A SentencePiece decoder strips the leading space of the text it decodes: the output
    decoded alone lost its first space ('the the' after 'abc', and the prompt plus the text
    read 'abcthe the'). It is decoded after the prompt's last tokens now, as SGLang does."""
    tok = byte_fallback_tokenizer
    ids = tok.encode("abc the quick fox", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    cut = next(i for i, p in enumerate(pieces) if i > 0 and p.startswith("▁"))
    prompt, output = ids[:cut], ids[cut:]
    want = tok.decode(ids)[len(tok.decode(prompt)) :]
    assert want.startswith(" ") and not tok.decode(output).startswith(" ")
    for per_step in (True, False):
        assert _detokenize_after(tok, prompt, output, per_step) == want, per_step


def test_an_output_cut_inside_a_character_keeps_the_characters_before(byte_fallback_tokenizer):
    """A byte-fallback decoder makes a byte run that is not UTF-8 as a whole U+FFFD: an output
    cut by max_tokens inside its last character read 9 x U+FFFD for '日本' and 2 bytes of
    '語' (non-streamed), or '日本' and several U+FFFD (streamed). Now '日本' and one U+FFFD."""
    tok = byte_fallback_tokenizer
    prompt = tok.encode("abc", add_special_tokens=False)
    whole = tok.encode("abc 日本語", add_special_tokens=False)[len(prompt) :]
    assert all(p.startswith("<0x") for p in tok.convert_ids_to_tokens(whole)[-9:])
    output = whole[:-1]  # the last character's third byte never came
    assert set(tok.decode(prompt + output)[len("abc") :]) <= {" ", "\ufffd"}
    want = tok.decode(prompt + whole)[len(tok.decode(prompt)) : -1] + "\ufffd"
    assert want.endswith("日本\ufffd")
    for per_step in (True, False):
        assert _detokenize_after(tok, prompt, output, per_step) == want, per_step


@pytest.mark.parametrize("tokenizer", ["byte_tokenizer", "byte_fallback_tokenizer"])
@pytest.mark.parametrize("bytes_in_prompt", [1, 2])
def test_a_prompt_ending_inside_a_character(request, tokenizer, bytes_in_prompt):
    """A prompt of token ids that ends inside a character (a continuation cut mid-character,
    an RL rollout): the output lost the character its first tokens completed ('本語' for
    'abc' + one byte of '日' prompted, '日本語' wanted). The text and the stop-string match
    both start with it whole."""
    tok = request.getfixturevalue(tokenizer)
    head = tok.encode("abc ", add_special_tokens=False)
    tail = tok.encode("abc 日本語", add_special_tokens=False)[len(head) :]
    assert len(tail) == 9  # one token a byte
    prompt, output = head + tail[:bytes_in_prompt], tail[bytes_in_prompt:]
    for per_step in (True, False):
        assert _detokenize_after(tok, prompt, output, per_step) == "日本語", per_step
    req, n = _run_to_stop(tok, prompt, output, stop="日本", max_new_tokens=100)
    assert req.finished_reason == finish_stop("日本") and n == 6 - bytes_in_prompt
    # A prompt ending with a U+FFFD of its own keeps it.
    prompt = tok.encode("abc \ufffd", add_special_tokens=False)
    output = tok.encode("abc \ufffd日本語", add_special_tokens=False)[len(prompt) :]
    for per_step in (True, False):
        assert _detokenize_after(tok, prompt, output, per_step) == "日本語", per_step


@pytest.mark.parametrize("stop", [" fox", " fo"])
def test_a_stop_string_with_a_leading_space_at_the_start_of_the_output(
    byte_fallback_tokenizer, stop
):
    """A SentencePiece decoder strips the leading space of what it decodes: the output's
    first tokens, decoded alone for the match, read 'fox', and a stop " fox" there was never
    matched (the client, sent the text decoded after the prompt, saw ' fox')."""
    tok = byte_fallback_tokenizer
    ids = tok.encode("abc the quick fox", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    cut = next(i for i, p in enumerate(pieces) if i > 0 and p.startswith("▁"))
    prompt, output = ids[:cut], ids[cut:]
    req, n = _run_to_stop(tok, prompt, output, stop=stop, max_new_tokens=100)
    assert tok.decode(output) == "fox"  # (decoded alone)
    assert req.finished_reason == finish_stop(stop) and n == len(output)


def test_the_scheduler_sends_the_prompts_last_tokens_with_the_first_output_only():
    from rs_fake_worker import FakeRun

    run = FakeRun(total_tokens=1024, overlap=False)
    sent = []
    run.s.send_output = sent.append
    prompt = list(range(10, 30))
    run.submit("r", prompt, max_new=3, stream=True)
    run.drain()
    contexts = [c for out in sent for c in out.decode_context]
    assert contexts == [prompt[-5:], [], []]


@pytest.mark.parametrize("stop", [None, ": "])
def test_a_cut_inside_a_character_keeps_the_space_its_token_began_with(default_tokenizer, stop):
    """SmolLM2's 'Ġè' is a space and the first byte of a 3-byte character: an output cut
    after it dropped the space ('\\nParent:' + U+FFFD, tokenizer.decode keeps it), and a stop
    string ": " then leaked ':' and U+FFFD (its occurrence was not found to cut)."""
    tok = default_tokenizer
    ids = [198, 17806, 42, 25792, 228]  # (the real model's sample: seed 122, temperature 1)
    assert tok.convert_ids_to_tokens(ids)[-2:] == ["Ġè", "Ĭ"]  # (2 of a character's 3 bytes)
    prompt = tok.encode("Translate to Chinese: good morning, friend.")
    for per_step in (True, False):
        got = (
            _detokenize_after(tok, prompt, ids, per_step)
            if stop is None
            else (_detokenize(tok, ids, stop, per_step))
        )
        assert got == ("\nParent: \ufffd" if stop is None else "\nParent"), per_step


def test_the_held_back_tail_is_the_longest_start_of_a_stop():
    """The hold-back (what a stream keeps until it can no longer become a stop string) tries
    only where a stop's first character is, not every length; the same lengths as trying
    every one, over random texts and stops."""
    import random

    from radixserve.managers.detokenizer_manager import _stop_prefix_len

    def every_length(text: str, stops: list[str]) -> int:
        return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)

    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 6))) for _ in range(3)]
        assert _stop_prefix_len(text, stops) == every_length(text, stops), (text, stops)
