"""The benchmarks (`python -m radixserve bench <kind>`), and the types of their numeric flags:
a count, length or duration outside its range ends the command with argparse's usage and one
line, before anything is loaded or sent."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)  # a ValueError is argparse's "invalid int value"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
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


POSITIVE = int_at_least(1)  # counts and lengths
NON_NEGATIVE = int_at_least(0)  # warm-up runs, seeds
SECONDS = float_in(0.0, low_open=True)  # durations and timeouts
FRACTION = float_in(0.0, 1.0)
PORT = int_at_least(1)
