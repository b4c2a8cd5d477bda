"""Checks of a GenerateReqInput before it is dispatched: the one validation path that the HTTP
server and the offline Engine share (both reach the scheduler through the TokenizerManager).

Every refusal is a RequestError naming the field; the scheduler never sees a bad value.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from radixserve.io_struct import GenerateReqInput
from radixserve.sampling_params import SamplingParams, is_int

MAX_N = 128  # choices per prompt
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and SGLang's practical one
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class RequestError(ValueError):
    """A request the server refuses (HTTP 400 unless status_code says otherwise)."""

    def __init__(
        self, message: str, status_code: int = 400, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers or {}


def _expect(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise RequestError(f"{name} must be {what}, got {value!r}")


def _expect_per_prompt(obj: GenerateReqInput, name: str, ok: Any, what: str) -> None:
    """A field that takes one value for every prompt, or (a batch) a list of one per prompt."""
    value = getattr(obj, name)
    if not isinstance(value, list):
        _expect(name, value, ok(value), what)
        return
    given = obj.text is not None or obj.input_ids is not None  # (else refused below)
    prompts = obj.batch_size if given and not obj.is_single else None
    _expect(name, value, len(value) == prompts, f"{what}, or a list of one per prompt")
    for v in value:
        _expect(name, v, ok(v), what)


def verify_request_fields(obj: GenerateReqInput) -> None:
    """Types and ranges of the request's own fields (sampling params are SamplingParams')."""
    _expect("stream", obj.stream, isinstance(obj.stream, bool), "a boolean")
    _expect_per_prompt(obj, "return_logprob", lambda v: isinstance(v, bool), "a boolean")
    _expect_per_prompt(
        obj,
        "top_logprobs_num",
        lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
        f"an integer in [0, {MAX_TOP_LOGPROBS}]",
    )
    _expect_per_prompt(
        obj,
        "logprob_start_len",
        lambda v: is_int(v) and v >= -1,
        "-1 (no prompt logprobs) or a prompt position >= 0",
    )
    _expect(
        "return_text_in_logprobs",
        obj.return_text_in_logprobs,
        isinstance(obj.return_text_in_logprobs, bool),
        "a boolean",
    )
    _expect("priority", obj.priority, obj.priority is None or is_int(obj.priority), "an integer")
    for name in ("extra_key", "routing_key"):
        value = getattr(obj, name)
        _expect(name, value, value is None or isinstance(value, str), "a string")
    _verify_prompt_and_rid(obj)
    _verify_bootstrap(obj)
    lora = obj.lora_path
    if isinstance(lora, list):
        # (one prompt may name its adapter in a one-item list, as SGLang takes it)
        ok = len(lora) == obj.batch_size and all(x is None or isinstance(x, str) for x in lora)
        _expect("lora_path", lora, ok, "an adapter name, or one (or null) per prompt of a batch")
    else:
        _expect("lora_path", lora, lora is None or isinstance(lora, str), "an adapter name")


def is_host(value: Any) -> bool:
    """A host name (RFC 1123 labels), an IPv4 address, or an IPv6 one (bracketed or bare)."""
    if not isinstance(value, str) or not value or len(value) > 253:
        return False
    try:
        ipaddress.ip_address(
            value[1:-1] if value.startswith("[") and value.endswith("]") else value
        )
        return True
    except ValueError:
        return all(_HOST_LABEL.fullmatch(label) for label in value.split("."))


def _verify_bootstrap(obj: GenerateReqInput) -> None:
    """The P/D pairing fields: one value, or one per prompt, or one per choice (prompts × n,
    SGLang's router sends these for n > 1); every sub-request needs a room of its own."""
    checks = (
        ("bootstrap_host", is_host, "a host name or IP address"),
        ("bootstrap_port", lambda v: is_int(v) and 0 < v < 65536, "a port"),
        ("bootstrap_room", lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    )
    rank = obj.data_parallel_rank
    _expect("data_parallel_rank", rank, rank is None or (is_int(rank) and rank >= 0), "a rank")
    batch = obj.batch_size
    subs = batch * num_choices(obj)
    for name, valid, what in checks:
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, list):
            ok = len(value) in (batch, subs) and all(map(valid, value))
            _expect(name, value, ok, f"{what}, or one per prompt or per choice")
        else:
            _expect(name, value, valid(value), what)
    if isinstance(obj.bootstrap_room, list):
        rooms = {obj.pairing(k)["bootstrap_room"] for k in range(subs)}
        if len(rooms) < subs:
            raise RequestError(
                f"bootstrap_room: the {subs} sub-requests (prompts × n) need different rooms "
                "(a prompt's room with n > 1 gives its choices room + j); give one room, or "
                "one per choice"
            )


def _verify_prompt_and_rid(obj: GenerateReqInput) -> None:
    text, ids = obj.text, obj.input_ids
    if (text is None) == (ids is None):
        raise RequestError("give exactly one of text and input_ids")
    if text is not None:
        ok = isinstance(text, str) or (
            isinstance(text, list) and bool(text) and all(isinstance(t, str) for t in text)
        )
        _expect("text", text, ok, "a string or a non-empty list of strings")
    else:
        ok = isinstance(ids, list) and (
            all(is_int(t) for t in ids)
            or (bool(ids) and all(isinstance(p, list) and all(map(is_int, p)) for p in ids))
        )
        _expect("input_ids", ids, ok, "a list of token ids or a non-empty list of such lists")
    rid = obj.rid
    if obj.is_single:
        _expect("rid", rid, rid is None or isinstance(rid, str), "a string")
    elif rid is not None and not isinstance(rid, str):  # one rid: the prompts get `<rid>_<i>`
        ok = isinstance(rid, list) and len(rid) == obj.batch_size
        ok = ok and all(isinstance(r, str) for r in rid)
        _expect("rid", rid, ok, "a string, or one string per prompt")
    sp = obj.sampling_params
    if isinstance(sp, list) and (obj.is_single or len(sp) != obj.batch_size):
        raise RequestError("sampling_params must be one dict, or one dict per prompt")
    for one in sp if isinstance(sp, list) else [sp]:
        _expect(
            "sampling_params", one, one is None or isinstance(one, (dict, SamplingParams)), "a dict"
        )


def num_choices(obj: GenerateReqInput) -> int:
    """`n` of the request (the same for every prompt of a batch), checked."""
    sps = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    ns = {_n_of(sp) for sp in sps}
    if len(ns) > 1:
        raise RequestError("n must be the same for every prompt of a batch")
    return ns.pop()


def _n_of(sp: Any) -> int:
    n = sp.n if isinstance(sp, SamplingParams) else (sp or {}).get("n", 1)
    _expect("n", n, is_int(n) and 1 <= n <= MAX_N, f"an integer in [1, {MAX_N}]")
    return n


def check_length(n: int, sp: SamplingParams, context_len: int, explicit: bool = True) -> None:
    """The prompt must leave room in the context; so must max_new_tokens where the request
    set it (`explicit`; its default is capped to the room left by the scheduler, as SGLang's)."""
    if n >= context_len:
        raise RequestError(
            f"The prompt has {n} tokens, which leaves no room in the model's context length "
            f"of {context_len} tokens (at most {context_len - 1} for at least one new token)."
        )
    if explicit and sp.max_new_tokens is not None and n + sp.max_new_tokens > context_len:
        raise RequestError(
            f"Requested {n + sp.max_new_tokens} tokens ({n} in the prompt, "
            f"{sp.max_new_tokens} to generate), which exceeds the model's context length "
            f"of {context_len} tokens."
        )
    if n + sp.min_new_tokens > context_len:  # (it could only end by length, short of it)
        raise RequestError(
            f"min_new_tokens (min_tokens) {sp.min_new_tokens} does not fit: the prompt has {n} "
            f"tokens and the model's context length is {context_len} (at most {context_len - n})."
        )
