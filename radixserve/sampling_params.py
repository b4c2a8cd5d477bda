"""SamplingParams: per-request generation controls, with SGLang's defaults and ranges.

Created by the TokenizerManager (or the offline Engine) from a user dict, verified before the
request is dispatched, then carried inside the request DTO to the Scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-6
TOP_K_ALL = 1 << 30


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


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
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
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
        return TOP_K_ALL if self.top_k in (-1, 0) else self.top_k

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first field that is out of range."""
        _check_type("temperature", self.temperature, (int, float))
        _check_type("top_p", self.top_p, (int, float))
        _check_type("top_k", self.top_k, int)
        _check_type("min_p", self.min_p, (int, float))
        if self.max_new_tokens is not None:
            _check_type("max_new_tokens", self.max_new_tokens, int)
            if self.max_new_tokens < 0:
                raise SamplingParamsError(
                    f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}"
                )
        _check_type("min_new_tokens", self.min_new_tokens, int)
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
        if not isinstance(self.n, int) or self.n < 1:
            raise SamplingParamsError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingParamsError(f"seed must be an integer, got {self.seed!r}")
        for tid in self.stop_token_ids or []:
            if not isinstance(tid, int) or tid < 0 or (vocab_size and tid >= vocab_size):
                raise SamplingParamsError(f"stop_token_ids has an invalid token id {tid!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strs):
            raise SamplingParamsError("stop must be a non-empty string or a list of them")
        grammars = [x for x in (self.json_schema, self.regex, self.ebnf) if x is not None]
        if len(grammars) > 1:
            raise SamplingParamsError("only one of json_schema, regex and ebnf may be set")
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise SamplingParamsError(f"logit_bias key {k!r} is not a token id") from None
                if tid < 0 or (vocab_size and tid >= vocab_size):
                    raise SamplingParamsError(f"logit_bias token id {tid} is out of range")
                if not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    raise SamplingParamsError(f"logit_bias value for {k} must be in [-100, 100]")


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise SamplingParamsError(f"{name} has the wrong type: {value!r}")
