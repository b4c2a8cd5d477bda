"""The benchmarks (`python -m radixserve bench <kind>`), and the types of their numeric flags:
a count, length or duration outside its range ends the command with argparse's usage and one
line, before anything is loaded or sent."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable


def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An int >= low; `why` (e.g. "TPOT needs two tokens") is added to the refusal."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError is argparse's "invalid int value"
        if value < low:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"must be >= {low}{reason}, got {text}")
        return value

    parse.__name__ = "int"
    return parse


def float_in(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """A float in [low, high] ((low, high] with low_open); nan is never one."""

    def parse(text: str) -> float:
        value = float(text)
        ok = (low < value if low_open else low <= value) and value <= high
        if not ok:
            bound = f"> {low}" if low_open else f">= {low}"
            raise argparse.ArgumentTypeError(
                f"must be {bound}"
                + (f" and <= {high}" if high < math.inf else "")
                + f", got {text}"
            )
        return value

    parse.__name__ = "float"
    return parse


def json_object(text: str) -> dict:
    """A flag's JSON object (e.g. --extra-request-body); anything else is argparse's error."""
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


json_object.__name__ = "JSON object"
POSITIVE = int_at_least(1)  # counts and lengths
NON_NEGATIVE = int_at_least(0)  # warm-up runs, seeds
SECONDS = float_in(0.0, low_open=True)  # durations and timeouts
FRACTION = float_in(0.0, 1.0)


def PORT(text: str) -> int:  # noqa: N802 (a flag type, named like the others)
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {text}")
    return value


def OUTPUT_FILE(text: str) -> str:  # noqa: N802 (a flag type, named like the others)
    """A file the result is appended to: refused before the run (it failed after it, the
    result lost) where it is a directory or its directory is not there or not writable."""
    where = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    if not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"{text}: its directory {where} does not exist")
    if not os.access(text if os.path.exists(text) else where, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written")
    return text


def kv_pool_tokens(num_requests: int, tokens_per_request: int, page_size: int) -> int:
    """A KV pool (--max-total-tokens) that holds `num_requests` requests of up to
    `tokens_per_request` tokens each at once: every request takes whole pages, and ModelRunner
    rounds the pool down to whole pages."""
    pages_per_request = -(-tokens_per_request // page_size)
    return num_requests * pages_per_request * page_size
