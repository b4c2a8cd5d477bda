"""Constrained decoding end to end through the Engine with the real model: 20 JSON schemas
(greedy and at temperature 1.0), regex and EBNF, all in one batch with unconstrained requests."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from schemas import SCHEMAS

from radixserve.managers.tokenizer_manager import RequestError

pytestmark = pytest.mark.real_model

REGEXES = [r"(yes|no)", r"\d{3}-\d{3}-\d{4}", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"]
ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [0-9]+
"""


@pytest.fixture(scope="module")
def engine(default_model_path):
    from radixserve import Engine

    with Engine(
        model_path=default_model_path,
        dtype="float32",
        max_total_tokens=32768,
        enable_integrity_checks=True,
    ) as e:
        yield e


def _prompt(engine, content: str) -> list[int]:
    return engine.tokenizer_manager.apply_chat_template([{"role": "user", "content": content}])


def test_everything_in_one_batch(engine):
    ids, params, checks = [], [], []
    for temperature in (0.0, 1.0):
        for name, schema in SCHEMAS:
            ids.append(_prompt(engine, f"Give me a JSON example of {name.replace('_', ' ')}."))
            params.append(
                {
                    "json_schema": json.dumps(schema),
                    "max_new_tokens": 256,
                    "temperature": temperature,
                    "seed": 7,
                }
            )
            checks.append(("json", schema))
        for pattern in REGEXES:
            ids.append(_prompt(engine, "Answer briefly."))
            params.append({"regex": pattern, "max_new_tokens": 32, "temperature": temperature})
            checks.append(("regex", pattern))
        ids.append(_prompt(engine, "Write a sum."))
        params.append({"ebnf": ARITH, "max_new_tokens": 32, "temperature": temperature})
        checks.append(("ebnf", None))
        for _ in range(4):  # unconstrained neighbours
            ids.append(_prompt(engine, "Tell me about Paris."))
            params.append({"max_new_tokens": 24, "temperature": temperature})
            checks.append(("free", None))
    outs = engine.generate(input_ids=ids, sampling_params=params)
    for out, (kind, spec) in zip(outs, checks, strict=True):
        text = out["text"]
        if kind == "json":
            assert out["meta_info"]["finish_reason"]["type"] == "stop", text
            jsonschema.validate(json.loads(text), spec)
        elif kind == "regex":
            assert re.fullmatch(spec, text), text
        elif kind == "ebnf":
            assert re.fullmatch(r"[0-9()+\-]+", text), text
        else:
            assert out["meta_info"]["completion_tokens"] > 0
    info = engine.get_server_info()
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]


@pytest.mark.parametrize(
    "params",
    [
        {"json_schema": '{"type": "object", "properties": {"a": {"type": "nope"}}}'},
        {"json_schema": "{not json"},
        {"regex": "(unclosed"},
        {"ebnf": "root ::= undefined_rule"},
        {"regex": "a", "json_schema": "{}"},
    ],
)
def test_invalid_grammar_is_a_clear_error(engine, params):
    with pytest.raises(RequestError) as e:
        engine.generate("x", {**params, "max_new_tokens": 4})
    assert str(e.value)
    assert engine.generate("ok", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1


def test_constrained_requests_share_the_radix_cache(engine):
    ids = _prompt(engine, "Describe a cat as JSON. " * 20)
    p = {"json_schema": json.dumps(SCHEMAS[0][1]), "max_new_tokens": 64, "temperature": 0}
    first = engine.generate(input_ids=ids, sampling_params=p)
    second = engine.generate(input_ids=ids, sampling_params=p)
    assert second["meta_info"]["cached_tokens"] >= len(ids) - 1
    assert first["text"] == second["text"]


def test_min_new_tokens_holds_under_a_grammar_that_can_go_on(engine):
    """The grammar's first EOS ended the request, min_new_tokens ignored (3 tokens for a
    minimum of 20); where the grammar can only end (a fixed answer), it ends there."""
    prompt = _prompt(engine, "Answer briefly.")
    params = [
        {"regex": r"(yes|no)( (yes|no))*", "min_new_tokens": 12, "max_new_tokens": 40},
        {"regex": r"(yes|no)", "min_new_tokens": 12, "max_new_tokens": 40},
    ]
    eos = engine.tokenizer_manager.eos_token_ids
    for p in params:  # (a model that ends wherever the grammar lets it)
        p.update(temperature=0.0, logit_bias={str(t): 100.0 for t in eos})
    going_on, fixed = engine.generate(input_ids=[prompt, prompt], sampling_params=params)
    assert going_on["meta_info"]["completion_tokens"] >= 12, going_on
    assert re.fullmatch(params[0]["regex"], going_on["text"]), going_on["text"]
    assert fixed["text"] in ("yes", "no") and fixed["meta_info"]["finish_reason"]["type"] == "stop"
