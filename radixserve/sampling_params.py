"""SamplingParams: per-request generation controls, with SGLang's defaults and ranges.

Created by the TokenizerManager (or the offline Engine) from a user dict, verified before the
request is dispatched, then carried inside the request DTO to the Scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-6
# Stops are matched against every step of the request, in the scheduler's loop: a million
# stop strings (a 10 MB body) made each step of every request take seconds, and the watchdog
# shut the server down. Bounds far past any real use (OpenAI takes 4 stop strings).
MAX_STOP_STRS = 256
MAX_STOP_STR_CHARS = 1024
MAX_STOP_TOKEN_IDS = 4096
TOP_K_ALL = 1 << 30


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


# SGLang's sampling parameters that radixserve does not implement: (the values that ask for
# nothing, why another is refused). The Engine (from_dict) and the HTTP bodies share it.
UNIMPLEMENTED_PARAMS: dict[str, tuple[tuple[Any, ...], str]] = {
    "stop_regex": ((None, [], ""), "stop strings are; stop regexes are not implemented"),
    "custom_params": ((None, {}), "custom logit processors are not implemented"),
}


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        # verify() refuses a stop or stop_token_ids that is not a list (kept as given here).
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strs = list(self.stop)
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        d = dict(d)
        # SGLang's names (its Engine scripts send them): sampling_seed is seed; stop regexes and
        # custom logit processors are not implemented, and accepted only empty.
        seed = d.pop("sampling_seed", None)
        if seed is not None and d.get("seed") is None:
            d["seed"] = seed
        for name, (empty, why) in UNIMPLEMENTED_PARAMS.items():
            if name in d and d.pop(name) not in empty:
                raise SamplingParamsError(f"{name} is not supported ({why})")
        known = cls.__dataclass_fields__
        unknown = [k for k in d if k not in known or k == "stop_strs"]
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise SamplingParamsError(str(e)) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def effective_top_k(self) -> int:
        return TOP_K_ALL if self.top_k in (-1, 0) else min(self.top_k, TOP_K_ALL)

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first field that is out of range."""
        for name in _REALS:
            _check_type(name, getattr(self, name), (int, float))
            if not math.isfinite(getattr(self, name)):
                raise SamplingParamsError(
                    f"{name} must be a finite number, got {getattr(self, name)}"
                )
        for name in _INTS:
            _check_type(name, getattr(self, name), int)
        for name in _OPTIONAL_INTS:
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in _STRINGS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SamplingParamsError(f"{name} must be a string, got {type(value).__name__}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}")
        if self.temperature < 0.0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise SamplingParamsError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.min_new_tokens < 0:
            raise SamplingParamsError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamsError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}")
        if not isinstance(self.stop_token_ids, list):
            raise SamplingParamsError(
                f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids, more than the "
                f"{MAX_STOP_TOKEN_IDS} a request may give"
            )
        for tid in self.stop_token_ids:
            if not is_int(tid) or tid < 0 or (vocab_size and tid >= vocab_size):
                raise SamplingParamsError(f"stop_token_ids has an invalid token id {tid!r}")
        stop_ok = self.stop is None or isinstance(self.stop, (str, list, tuple))
        if not stop_ok or any(not isinstance(s, str) or not s for s in self.stop_strs):
            raise SamplingParamsError("stop must be a non-empty string or a list of them")
        if len(self.stop_strs) > MAX_STOP_STRS:
            raise SamplingParamsError(
                f"stop has {len(self.stop_strs)} strings, more than the {MAX_STOP_STRS} a "
                "request may give"
            )
        if any(len(s) > MAX_STOP_STR_CHARS for s in self.stop_strs):
            raise SamplingParamsError(
                f"stop has a string longer than {MAX_STOP_STR_CHARS} characters"
            )
        grammars = [x for x in (self.json_schema, self.regex, self.ebnf) if x is not None]
        if len(grammars) > 1:
            raise SamplingParamsError("only one of json_schema, regex and ebnf may be set")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError("logit_bias must be a map of token id to bias")
            error = logit_bias_key_error(self.logit_bias)
            if error is not None:
                raise SamplingParamsError(error)
            for k, v in self.logit_bias.items():
                tid = int(k)
                if tid < 0 or (vocab_size and tid >= vocab_size):
                    raise SamplingParamsError(f"logit_bias token id {tid} is out of range")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise SamplingParamsError(f"logit_bias value for {k} must be in [-100, 100]")


def logit_bias_key_error(logit_bias: dict[Any, Any]) -> str | None:
    """Why logit_bias's keys are not one token id each (decimal digits, or ints), or None.
    int() also reads " 5", "+5", "05", "1_0", "٥": each spelling of one id added its bias
    again, past the ±100 bound."""
    seen: dict[int, Any] = {}
    for k in logit_bias:
        plain = isinstance(k, str) and k.isascii() and k.isdigit()
        if not plain and not (isinstance(k, int) and not isinstance(k, bool)):
            return f"logit_bias key {k!r} is not a token id"
        tid = int(k)
        if tid in seen:
            return f"logit_bias names token {tid} twice ({seen[tid]!r} and {k!r})"
        seen[tid] = k
    return None


_REALS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_INTS = ("min_new_tokens", "top_k", "n")
_OPTIONAL_INTS = ("max_new_tokens", "seed")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
_STRINGS = ("json_schema", "regex", "ebnf")


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise SamplingParamsError(f"{name} has the wrong type: {value!r}")
