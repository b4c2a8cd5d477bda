"""XGrammarBackend with the default model's tokenizer, driven by a scripted "model".

The scripted model samples uniformly from the grammar's allowed tokens for a few steps, then
steers towards completion (EOS, closing characters, commas, digits before anything else), so
that every generation terminates. Whatever it picks, the decoded text must satisfy the grammar.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import Counter
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch
from schemas import SCHEMAS  # sibling module; pytest puts this folder on sys.path

from radixserve.constrained import xgrammar_backend
from radixserve.constrained.xgrammar_backend import (
    ANY_JSON,
    COMPILE_WORKERS,
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    Grammar,
    InvalidGrammar,
    XGrammarBackend,
    grammar_key,
)
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model  # the default model's tokenizer

MAX_STEPS = 400
SEEDS = (0, 1)


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer):
    return default_tokenizer  # the session's (see conftest.py)


@pytest.fixture(scope="session")
def backend(tokenizer):
    b = XGrammarBackend(
        tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id]
    )
    yield b
    b.close()


# -- the scripted model ----------------------------------------------------------------------
_CLOSERS = b'"}])'
_OPENERS = b"{[("


def _finish_rank(byte: int, used: Counter) -> tuple:
    """Smaller = preferred while finishing: closers, comma, digits, the least-used other
    character, openers, whitespace last (it never makes progress)."""
    if byte in _CLOSERS:
        return (0, _CLOSERS.index(byte))
    if byte == ord(","):
        return (1, 0)
    if ord("0") <= byte <= ord("9"):
        return (2, byte)
    if byte in _OPENERS:
        return (4, byte)
    if chr(byte).isspace():
        return (5, byte)
    return (3, used[byte], byte)


def allowed_ids(backend: XGrammarBackend, grammar: Grammar) -> list[int]:
    mask = backend.allocate_vocab_mask(1)
    grammar.fill_vocab_mask(mask, 0)
    return (
        (~XGrammarBackend.unpack_vocab_mask(mask, backend.vocab_size)[0])
        .nonzero()
        .view(-1)
        .tolist()
    )


class ScriptedModel:
    """Picks each next token from what the grammar allows. Uniform draws first (whitespace
    only when nothing else is allowed: with any_whitespace it is most of the choices), then
    the single-byte token that closes the most (see _finish_rank), EOS as soon as allowed."""

    def __init__(self, backend: XGrammarBackend, tokenizer) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        self.vocab = list(backend.tokenizer_info.decoded_vocab)  # bytes of each token
        self.single = np.array([len(v) == 1 for v in self.vocab])
        self.blank = np.array([bool(v) and not v.strip() for v in self.vocab])
        self.eos = tokenizer.eos_token_id

    def allowed(self, grammar: Grammar) -> np.ndarray:
        """[V] bool, True = allowed next (numpy: the driver's own unpacking, kept cheap)."""
        mask = self.backend.allocate_vocab_mask(1)
        grammar.fill_vocab_mask(mask, 0)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
        return bits[: self.backend.vocab_size].astype(bool)

    def pick(self, allowed: np.ndarray, random_phase: bool, rng, used: Counter) -> int:
        if random_phase:
            visible = allowed & ~self.blank
            pool = np.flatnonzero(visible if visible.any() else allowed)
            return int(pool[rng.randrange(len(pool))])
        if allowed[self.eos]:
            return self.eos
        single = np.flatnonzero(allowed & self.single).tolist()
        if not single:
            return min(np.flatnonzero(allowed).tolist(), key=lambda t: (len(self.vocab[t]), t))
        return min(single, key=lambda t: _finish_rank(self.vocab[t][0], used))

    def generate(self, key, seed: int) -> str:
        """Run under `key`'s grammar to EOS; return the decoded text."""
        compiled = self.backend.get_future(key).result(timeout=60)
        assert not isinstance(compiled, InvalidGrammar), compiled
        grammar = self.backend.new_matcher(compiled)
        rng = random.Random(seed)
        random_steps = rng.randint(3, 30)
        used: Counter = Counter()
        out: list[int] = []
        for step in range(MAX_STEPS):
            allowed = self.allowed(grammar)
            assert allowed.any(), f"empty mask after {out}"
            token = self.pick(allowed, step < random_steps, rng, used)
            assert grammar.accept_token(token)
            if token == self.eos:
                assert grammar.is_terminated()
                assert np.flatnonzero(self.allowed(grammar)).tolist() == [self.eos]
                break
            out.append(token)
            used.update(self.vocab[token])
        else:
            pytest.fail(f"no EOS after {MAX_STEPS} steps: {self.tokenizer.decode(out)!r}")
        text = b"".join(self.vocab[t] for t in out).decode("utf-8")
        # What users see is the detokenizer's text: it must be the bytes the grammar matched.
        shown = self.tokenizer.decode(
            out, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        assert shown == text
        return text


@pytest.fixture(scope="session")
def model(backend, tokenizer) -> ScriptedModel:
    return ScriptedModel(backend, tokenizer)


# -- generation satisfies the grammar --------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name,schema", SCHEMAS, ids=[n for n, _ in SCHEMAS])
def test_json_schema_output_validates(model, name, schema, seed):
    text = model.generate(("json", json.dumps(schema)), seed)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", range(4))
def test_any_json(model, seed):
    json.loads(model.generate(("json", ANY_JSON), seed))


REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(yes|no)",
    r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
    r"#[0-9a-fA-F]{6}",
    r"[A-Z][a-z]+( [A-Z][a-z]+)*",
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_output_fullmatches(model, pattern, seed):
    text = model.generate(("regex", pattern), seed)
    assert re.fullmatch(pattern, text), text


ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9]+
"""

LIST = r"""
root ::= "[" (item ("," item)*)? "]"
item ::= [a-z]+ | "\"" [a-z ]* "\""
"""


def parse_arith(text: str) -> None:
    """Recursive-descent check of ARITH; raises ValueError on a syntax error."""
    pos = 0

    def expect_expr() -> None:
        nonlocal pos
        expect_term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            expect_term()

    def expect_term() -> None:
        nonlocal pos
        expect_factor()
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            expect_factor()

    def expect_factor() -> None:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            expect_expr()
            if pos >= len(text) or text[pos] != ")":
                raise ValueError(f"')' expected at {pos} in {text!r}")
            pos += 1
            return
        m = re.compile(r"[0-9]+").match(text, pos)
        if not m:
            raise ValueError(f"number expected at {pos} in {text!r}")
        pos = m.end()

    expect_expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")


def test_parse_arith_rejects_bad_input():
    parse_arith("(1+2)*30")
    for bad in ["", "1+", "(1", "1)", "a"]:
        with pytest.raises(ValueError):
            parse_arith(bad)


@pytest.mark.parametrize("seed", range(4))
def test_ebnf_arithmetic(model, seed):
    parse_arith(model.generate(("ebnf", ARITH), seed))


@pytest.mark.parametrize("seed", range(4))
def test_ebnf_list(model, seed):
    text = model.generate(("ebnf", LIST), seed)
    item = r'([a-z]+|"[a-z ]*")'
    assert re.fullmatch(rf"\[({item}(,{item})*)?\]", text), text


# -- masks, tokens, EOS --------------------------------------------------------------------
def test_rejected_token_leaves_state_unchanged(backend, tokenizer):
    grammar = backend.new_matcher(backend.get_future(("regex", "(yes|no)")).result())
    before = allowed_ids(backend, grammar)
    assert not grammar.accept_token(tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert not grammar.accept_token(tokenizer.eos_token_id)  # EOS only where the grammar ends
    assert allowed_ids(backend, grammar) == before
    for t in tokenizer.encode("no", add_special_tokens=False):
        assert grammar.accept_token(t)
    assert allowed_ids(backend, grammar) == [tokenizer.eos_token_id]
    grammar.rollback(1)
    assert allowed_ids(backend, grammar) == before


@pytest.mark.parametrize("kind", ["string", ["string", "null"]], ids=["string", "nullable"])
@pytest.mark.parametrize(
    "bounds", [{"maxLength": 6}, {"minLength": 2}, {"minLength": 1, "maxLength": 3}]
)
def test_length_bounded_strings_admit_no_raw_control_character(backend, tokenizer, bounds, kind):
    """xgrammar 0.2.9 compiles a string with minLength / maxLength as any characters but
    quote, backslash, CR and LF: a raw tab or \\x02 made the output invalid JSON (a nullable
    string, type ["string", "null"], was missed by the first fix)."""
    schema = {"type": "object", "properties": {"c": {"type": kind, **bounds}}}
    grammar = backend.new_matcher(backend.get_future(("json", json.dumps(schema))).result())
    for t in tokenizer.encode('{"c": "a', add_special_tokens=False):
        assert grammar.accept_token(t)
    allowed = allowed_ids(backend, grammar)
    texts = {t: tokenizer.decode([t]) for t in allowed}
    assert any(text == "b" for text in texts.values())
    control = [
        t for t in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))
    ]
    assert len(control) > 10 and not set(control) & set(allowed)
    if "maxLength" in bounds:  # the bound still holds
        for t in tokenizer.encode("b" * (bounds["maxLength"] - 1), add_special_tokens=False):
            assert grammar.accept_token(t)
        assert {texts.get(t, tokenizer.decode([t]))[0] for t in allowed_ids(backend, grammar)} == {
            '"'
        }


def test_the_schema_walk_before_a_compile_is_linear(monkeypatch):
    """The walk that rewrites bounded strings visited "items" twice (it is a schema keyword and
    a list one): items nested n deep took 2^n steps, and the compile thread of a 300-deep
    schema never ended, holding the GIL (the test suite ran for hours)."""
    from radixserve.constrained import xgrammar_backend

    walk = xgrammar_backend.rewrite_for_xgrammar
    calls = 0

    def counted(schema):
        nonlocal calls
        calls += 1
        return walk(schema)

    monkeypatch.setattr(xgrammar_backend, "rewrite_for_xgrammar", counted)
    schema: dict = {"type": "string", "maxLength": 3}
    for _ in range(18):
        schema = {"type": "array", "items": schema, "prefixItems": [{"type": "integer"}]}
    before = json.dumps(schema)
    out = counted(schema)
    assert json.dumps(schema) == before  # a copy: the request's schema is left as it was
    assert calls <= 3 * 19  # the array, its list of prefix items and that item, per level
    for _ in range(18):
        out = out["items"]
    assert out == {"type": "string", "pattern": f"^{xgrammar_backend._PLAIN_CHAR}{{0,3}}$"}


def test_special_tokens_and_padding_never_allowed(tokenizer):
    padded = len(tokenizer) + 64  # model vocab larger than the tokenizer's
    eos = [tokenizer.eos_token_id, 0]
    b = XGrammarBackend(tokenizer, vocab_size=padded, eos_token_ids=eos)
    try:
        grammar = b.new_matcher(b.get_future(("json", ANY_JSON)).result())
        for t in tokenizer.encode('{"a', add_special_tokens=False):  # inside a string
            assert grammar.accept_token(t)
        allowed = set(allowed_ids(b, grammar))
        assert len(allowed) > 1000
        assert not allowed & set(tokenizer.all_special_ids)
        assert not allowed & set(range(len(tokenizer), padded))
        for t in tokenizer.encode('":1}', add_special_tokens=False):
            assert grammar.accept_token(t)
        assert sorted(allowed_ids(b, grammar)) == sorted(eos)
        assert grammar.accept_token(0) and grammar.is_terminated()
        assert sorted(allowed_ids(b, grammar)) == sorted(eos)
    finally:
        b.close()


def test_batch_mask_rows_and_apply(backend, tokenizer):
    grammar = backend.new_matcher(backend.get_future(("regex", r"[0-9]+")).result())
    mask = backend.allocate_vocab_mask(3)
    grammar.fill_vocab_mask(mask, 1)  # rows 0 and 2: unconstrained requests
    forbidden = XGrammarBackend.unpack_vocab_mask(mask, backend.vocab_size)
    assert not forbidden[0].any() and not forbidden[2].any()
    digits = [t for t in range(backend.vocab_size) if not forbidden[1, t]]
    assert digits and all(tokenizer.decode([t]).isdigit() for t in digits)

    torch.manual_seed(0)
    logits = torch.randn(3, backend.vocab_size)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):  # float64: unpacked path
        got = logits.to(dtype)
        XGrammarBackend.apply_vocab_mask(got, mask)
        want = logits.to(dtype).masked_fill(forbidden, float("-inf"))
        assert torch.equal(got, want), dtype


# -- compilation: errors, cache, threads ------------------------------------------------------
INVALID = [
    ("json", '{"type": "foo"}', "foo"),
    ("json", "not json", "JSON"),
    ("regex", "(abc", "parenthesis"),
    ("ebnf", "root ::= foo", "foo"),
    ("ebnf", 'root ::= "a', ""),
]


@pytest.mark.parametrize("kind,text,needle", INVALID)
def test_invalid_grammar_resolves_with_message(backend, kind, text, needle):
    result = backend.get_future((kind, text)).result()
    assert isinstance(result, InvalidGrammar)
    assert result.key == (kind, text)
    assert needle in result.message and not result.message.startswith("[")
    assert backend.validate(kind, text) == result.message


@pytest.mark.parametrize(
    "pattern,needle",
    [
        (r"\A(yes|no)\Z", "the escape \\A is not supported (the whole output matches"),
        (r"(yes|no)\z", "the escape \\z is not supported"),
        (r"[a-z]+\Qx\E", "the escape \\Q is not supported"),
    ],
)
def test_regex_escapes_read_as_plain_letters_are_refused(backend, pattern, needle):
    r"""xgrammar reads an escape it does not know as the letter: \A(yes|no)\Z served "AyesZ"
    with finish "stop"."""
    message = backend.validate("regex", pattern)
    assert message is not None and needle in message
    for fine in (r"\d{3}\s\w+", r"a\\Ab", r"\x41\t[\d\-]"):  # (\\A: a backslash, then A)
        assert backend.validate("regex", fine) is None, fine


def test_validate_accepts_valid_grammars(backend):
    assert backend.validate("json", json.dumps(SCHEMAS[0][1])) is None
    assert backend.validate("regex", "(yes|no)") is None
    assert backend.validate("ebnf", ARITH) is None
    assert "unknown grammar kind" in backend.validate("xml", "<a/>")
    with pytest.raises(ValueError):
        backend.get_future(("xml", "<a/>"))


ARRAY = {"type": "array", "items": {"type": "integer"}}
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
UNENFORCED = [  # keywords xgrammar accepts and ignores: a "stop" would not mean "matches"
    ({**ARRAY, "uniqueItems": True}, "uniqueItems at #"),
    ({"type": "integer", "not": {"enum": [1]}}, "not at #"),
    ({**OBJECT, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if at #, then at #"),
    ({**OBJECT, "dependentRequired": {"a": ["b"]}}, "dependentRequired at #"),
    ({**ARRAY, "contains": {"const": 5}}, "contains at #"),
    ({"allOf": [OBJECT, {"required": ["b"]}]}, "allOf of several schemas at #"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf of a non-integer at #"),
    ({**OBJECT, "properties": {"x": {**ARRAY, "uniqueItems": True}}}, "at #/properties/x"),
    ({"$defs": {"D": {"not": {}}}, "$ref": "#/$defs/D"}, "not at #/$defs/D"),
    # xgrammar 0.2.9 takes the pattern or format alone ("yes" for minLength 12), ignores
    # draft 7's dependencies, and reads a $ref into another document as any value.
    (
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 12},
        "minLength/maxLength beside pattern or format at #",
    ),
    ({"type": "string", "format": "date", "maxLength": 3}, "beside pattern or format at #"),
    ({**OBJECT, "dependencies": {"a": ["b"]}}, "dependencies at #"),
    ({"$ref": "other.json#/x"}, "$ref to another document (other.json#/x) at #"),
    (
        {**OBJECT, "required": ["a", "c"], "additionalProperties": False},
        "required names not in properties at #",
    ),
]


@pytest.mark.parametrize("schema,needle", UNENFORCED)
def test_schemas_with_keywords_that_would_not_be_enforced_are_refused(backend, schema, needle):
    message = backend.validate("json", json.dumps(schema))
    assert message is not None and "cannot enforce" in message and needle in message


@pytest.mark.parametrize(
    "schema, needle",
    [
        (
            {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "maximum": 6},
            "maximum beside $ref at #",
        ),
        ({"type": "string", "enum": ["aaa", "b"], "maxLength": 2}, "beside enum at #"),
        (  # (additionalProperties false, and a branch adds a name: not one schema)
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": False,
                "anyOf": [{"properties": {"b": {"type": "string"}}, "required": ["b"]}],
            },
            "beside anyOf at #",
        ),
    ],
)
def test_keywords_beside_one_read_alone_are_folded_or_refused(backend, schema, needle):
    """xgrammar reads anyOf / oneOf / allOf / $ref / enum / const alone: what sits beside them
    was dropped (served, ending with "stop", not matching). Folded in where that keeps the
    meaning (SCHEMAS: *_beside_*), refused where not; annotations beside them are fine."""
    message = backend.validate("json", json.dumps(schema))
    assert message is not None and "cannot enforce" in message and needle in message
    described = {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "description": "d"}
    assert backend.validate("json", json.dumps(described)) is None


@pytest.mark.parametrize("seed", range(4))
def test_a_pydantic_discriminated_union_is_served_and_kept(backend, model, seed):
    """pydantic writes `discriminator` (OpenAPI's) beside a union of $refs: refused as a
    constraint that would not be enforced, though each branch's `const` does the work; and
    `x-` extensions and `example` beside $ref or enum likewise."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Owner(BaseModel):
        pet: Cat | Dog = Field(discriminator="pet_type")

    schema = Owner.model_json_schema()
    assert "discriminator" in schema["properties"]["pet"]
    assert backend.validate("json", json.dumps(schema)) is None
    jsonschema.validate(json.loads(model.generate(("json", json.dumps(schema)), seed)), schema)
    for annotated in (
        {"enum": ["a", "b"], "x-order": 1},
        {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "example": 3},
    ):
        assert backend.validate("json", json.dumps(annotated)) is None, annotated


def test_keywords_that_are_enforced_or_only_name_things_are_accepted(backend):
    for schema in (
        {"type": "integer", "multipleOf": 3},
        {"allOf": [OBJECT]},
        {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"const": 1}}},
        {"enum": [{"not": 1}, {"uniqueItems": True}]},  # data, not keywords
        {"type": "string", "format": "date"},
    ):
        assert backend.validate("json", json.dumps(schema)) is None, schema


@pytest.mark.parametrize(
    "kind,text,needle",
    [
        ("json", '{"anyOf": []}', "the schema admits no value"),
        ("json", '{"oneOf": []}', "the schema admits no value"),
        ("regex", r"[^\s\S]", "it admits no output"),
        ("ebnf", "root ::= root", "it admits no output"),
    ],
)
def test_grammars_that_admit_no_output_are_refused(backend, kind, text, needle):
    message = backend.validate(kind, text)
    assert message is not None and needle in message


def test_required_names_outside_properties_are_required(backend, tokenizer):
    """xgrammar 0.2.9 ignores a required name that properties does not list: {"required":
    ["name"]} generated {} and ended with "stop"."""
    schema = json.dumps({"type": "object", "required": ["name"]})
    assert backend.validate("json", schema) is None
    eos = tokenizer.eos_token_id
    for text, complete in (("{}", False), ('{"name": 1}', True)):
        grammar = backend.new_matcher(backend.get_future(("json", schema)).result())
        ids = tokenizer.encode(text, add_special_tokens=False)
        ok = all(grammar.accept_token(t) for t in ids) and grammar.accept_token(eos)
        assert ok == complete, text


@pytest.mark.parametrize(
    "text,needle",
    [
        (lambda: json.dumps(_nested(MAX_SCHEMA_DEPTH)), "nests deeper than 128 levels"),
        (lambda: "[" * 5000 + "]" * 5000, "nests deeper than 128 levels"),  # (json.loads fails)
        (
            lambda: json.dumps({"properties": {f"p{i}": {} for i in range(MAX_SCHEMA_NODES)}}),
            "more than 10000 subschemas",
        ),
    ],
    ids=["deep", "deeper-than-python", "wide"],
)
def test_schemas_too_large_to_compile_in_time_are_refused_at_once(backend, text, needle):
    """1,500 levels of nesting compiled for minutes (past the timeout, holding a compile
    thread and the server's exit); refused before compiling now."""
    message = backend.validate("json", text())
    assert message is not None and needle in message
    assert backend.validate("json", json.dumps(_nested(MAX_SCHEMA_DEPTH - 1))) is None


@pytest.mark.parametrize("kind", ["json", "regex", "ebnf"])
def test_a_grammar_text_past_the_size_served_is_refused_before_compiling(
    backend, kind, monkeypatch
):
    """An enum of 100,000 strings (1.7 MB) compiled for 45 s into about 500 MB, in the
    TokenizerManager and in the scheduler, and the cache kept it."""
    monkeypatch.setattr(backend, "get_future", None)  # (refused before any compile)
    message = backend.validate(kind, "x" * (MAX_GRAMMAR_CHARS + 1))
    assert message is not None and f"more than the {MAX_GRAMMAR_CHARS} served" in message


def test_the_grammar_cache_is_bounded_by_bytes(tokenizer, monkeypatch):
    """The cache kept 1024 compiled grammars of any size: gigabytes for large enums."""
    b = XGrammarBackend(tokenizer, vocab_size=len(tokenizer))
    try:
        schemas = [json.dumps({"enum": [f"v{k}_{i}" for i in range(300)]}) for k in range(3)]
        sizes = [b.get_future(("json", s)).result(30).memory_size_bytes for s in schemas]
        b.get_future(("json", schemas[2]))  # (the next request counts the compiles done)
        assert b.cache_bytes == sum(sizes) and len(b._cache) == 3
        # A budget for the newest two: the least recently used leaves.
        monkeypatch.setattr(xgrammar_backend, "GRAMMAR_CACHE_BYTES", sizes[1] + sizes[2])
        b.get_future(("json", schemas[2]))
        assert list(b._cache) == [("json", schemas[1]), ("json", schemas[2])]
        assert b.cache_bytes == sizes[1] + sizes[2]
    finally:
        b.close()


def _nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_compiles_whose_waiters_gave_up_do_not_hold_the_workers(tokenizer):
    """A compile refused for its time runs on (C++ cannot be stopped): four of them held
    every compile thread, and every grammar after them was refused as well."""
    b = XGrammarBackend(tokenizer, vocab_size=len(tokenizer))
    release = threading.Event()
    compile_ = b._compile

    def slow_or_not(key):
        if key[1].startswith("slow"):
            release.wait(30)
        return compile_(key)

    b._compile = slow_or_not  # type: ignore[method-assign]
    try:
        for i in range(COMPILE_WORKERS + 2):
            assert "did not compile within" in b.validate("regex", f"slow{i}", timeout=0.05)
        assert b.validate("regex", "[0-9]{3}x", timeout=10) is None
    finally:
        release.set()
        b.close()


def test_a_slow_compile_is_refused_after_the_timeout_and_does_not_hold_up_others(tokenizer):
    """One schema that takes long to compile neither blocks new grammars (compiles run on
    several threads) nor its request forever (validate's timeout)."""
    b = XGrammarBackend(tokenizer, vocab_size=len(tokenizer))
    try:
        slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
        message = b.validate("json", json.dumps(slow), timeout=0.01)
        assert message is not None and "did not compile within" in message
        assert b.validate("regex", "[0-9]{3}x", timeout=30) is None  # while the slow one runs
    finally:
        b.close()


def test_closing_fails_the_compiles_in_flight_at_once(tokenizer):
    """A check waiting on a compile still running when its backend closed (a stopping server:
    the grammar check of a request in flight) waited until the compile ended, tens of
    seconds for a large schema."""
    b = XGrammarBackend(tokenizer, vocab_size=len(tokenizer))
    slow = {"type": "integer"}
    for _ in range(300):
        slow = {"type": "array", "items": slow}
    future = b.get_future(("json", json.dumps(slow)))
    queued = [b.get_future(("regex", f"[0-9]{{{n}}}x")) for n in range(1, 9)]
    b.close()
    with pytest.raises(RuntimeError, match="the grammar backend is closed"):
        future.result(1)
    assert all(f.done() for f in queued)  # compiled already, or failed by close()
    with pytest.raises(RuntimeError, match="closed"):
        b.get_future(("regex", "[a-z]")).result(1)


def test_cache_returns_same_compiled_object(backend):
    key = ("regex", r"[a-c]{2}")
    f1, f2 = backend.get_future(key), backend.get_future(key)
    assert isinstance(f1, Future) and f1 is f2
    assert f1.result() is backend.get_future(key).result()
    assert backend.get_future(("regex", r"[a-d]{2}")) is not f1


def test_compiles_on_worker_thread_and_evicts_lru(tokenizer):
    b = XGrammarBackend(tokenizer, vocab_size=len(tokenizer), max_cache_entries=2)
    threads: list[str] = []
    real = b.compiler

    class Recorder:
        def __getattr__(self, name):
            threads.append(threading.current_thread().name)
            return getattr(real, name)

    b.compiler = Recorder()
    try:
        f = b.get_future(("regex", "a+"))
        f.result()
        assert threads and threading.current_thread().name not in threads
        b.get_future(("regex", "b+"))
        b.get_future(("regex", "c+"))  # evicts "a+", the least recently used
        assert b.get_future(("regex", "a+")) is not f
    finally:
        b.close()


def test_grammar_key():
    assert grammar_key(SamplingParams()) is None
    assert grammar_key(SamplingParams(json_schema="{}")) == ("json", "{}")
    assert grammar_key(SamplingParams(regex="a")) == ("regex", "a")
    assert grammar_key(SamplingParams(ebnf='root ::= "a"')) == ("ebnf", 'root ::= "a"')


def test_the_check_validates_the_grammar_the_scheduler_serves(tokenizer):
    """The TokenizerManager's check compiled schemas with free whitespace, the scheduler
    without: the check validated another grammar than the one served."""
    from radixserve.managers.grammar_check import GrammarCheck
    from radixserve.managers.grammar_manager import GrammarManager

    check = GrammarCheck("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    served = GrammarManager("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        check.check(SamplingParams(json_schema='{"type": "integer"}'))
        assert check._backend.any_whitespace == served.backend.any_whitespace
    finally:
        check.close()
        served.close()


def test_a_compile_its_waiters_gave_up_on_takes_one_thread_more_not_one_per_waiter():
    """Every request for a schema waits on its one compile: each that timed out started
    another compile thread (40 timed-out requests for one slow schema left 41 threads)."""
    import threading
    import time

    from radixserve.constrained.xgrammar_backend import _CompilePool

    pool = _CompilePool(2)
    release = threading.Event()
    future = pool.submit(release.wait, 30)
    for _ in range(500):
        if future.running():
            break
        time.sleep(0.01)
    before = len(pool._threads)
    for _ in range(10):
        pool.abandon(future)
    assert len(pool._threads) == before + 1
    release.set()
    future.result(10)
    pool.close()
