"""What the soak run (`bench.soak`, `bench.soak_actions`) sends: seeded prompts, chat messages,
the bad inputs (each with the 4xx statuses it must get) and the grammar requests' JSON schema.

Prompts mix short ones, long ones (up to `max_words`, so that chunked prefill runs) and ones that
start with a shared prefix (so that the radix cache matches, splits and evicts).
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which "
    "river city market grain salt cloth town walls avenue park railway station museum "
    "university bakery bread dawn hand visitor quarter fire century stone builder hill north "
    "story light water garden window road bridge winter summer morning evening music letter "
    "number seven twelve hundred green blue quiet bright old new small large first last"
).split()
SHARED_PREFIX = (
    "You are a careful assistant. Answer in one short paragraph, use plain words, and do not "
    "repeat the question. The topic follows after the colon, read it closely: "
)
SYSTEM_PROMPT = "You are a helpful assistant who answers briefly and never uses lists."
# No maxLength: xgrammar 0.2.9 compiles a bounded string to a rule that admits raw control
# characters, which JSON forbids, so the output would not parse.
GRAMMAR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
_USER = {"role": "user", "content": "Say hello."}
# (path, body, HTTP statuses that are right). Bodies for /v1 paths get "model" added unless
# they name one; bytes are sent as they are.
BAD_INPUTS: list[tuple[str, Any, frozenset[int]]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, frozenset({400})),
    ("/v1/completions", {"prompt": "x", "stop": ["x"] * 257}, frozenset({400})),
    ("/v1/chat/completions", {"messages": [_USER], "temperature": "x"}, frozenset({400})),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [_USER]}, frozenset({404})),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, frozenset({404})),
    ("/v1/completions", {"prompt": ""}, frozenset({400})),
    ("/v1/completions", {"prompt": []}, frozenset({400})),
    ("/v1/chat/completions", {"messages": []}, frozenset({400})),
    ("/v1/completions", b"{not json", frozenset({400})),
    ("/v1/chat/completions", b"", frozenset({400})),
    ("/generate", b'{"text": "x", "sampling_params": {', frozenset({400})),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "a"}}, frozenset({400})),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, frozenset({400})),
    ("/generate", {"sampling_params": {}}, frozenset({400})),
    ("/v1/completions", {"prompt": [10**9]}, frozenset({400})),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**7}, frozenset({400})),
    ("/v1/completions", {"prompt": "x", "stream": True, "top_p": 2}, frozenset({400})),
    ("/v1/chat/completions", {"messages": [_USER], "n": -2}, frozenset({400})),
    (
        "/v1/chat/completions",
        {
            "messages": [_USER],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
            },
        },
        frozenset({400}),
    ),
]


def _words(rng: random.Random, max_words: int) -> str:
    if rng.random() < 0.1:  # long: several prefill chunks
        n = rng.randint(max(1, max_words // 2), max(1, max_words))
    else:
        n = rng.randint(1, max(1, min(40, max_words)))
    return " ".join(rng.choices(WORDS, k=n))


def make_prompt(rng: random.Random, max_words: int) -> str:
    prefix_words = len(SHARED_PREFIX.split())
    if max_words > 2 * prefix_words and rng.random() < 0.3:
        return SHARED_PREFIX + _words(rng, max_words - prefix_words)
    return _words(rng, max_words)


def make_messages(rng: random.Random, max_words: int) -> list[dict[str, str]]:
    system_words = len(SYSTEM_PROMPT.split())
    if max_words > 2 * system_words and rng.random() < 0.5:
        user = {"role": "user", "content": _words(rng, max_words - system_words)}
        return [{"role": "system", "content": SYSTEM_PROMPT}, user]
    return [{"role": "user", "content": _words(rng, max_words)}]


def matches_schema(text: str) -> bool:
    """Whether `text` is a JSON document that GRAMMAR_SCHEMA accepts."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if not isinstance(obj, dict) or set(obj) != {"name", "age"}:
        return False
    name, age = obj["name"], obj["age"]
    return isinstance(name, str) and type(age) is int
