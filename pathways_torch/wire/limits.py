"""Bounds on the numbers a tenant hands a shared controller: refused where they enter, with the bounds named.

A cost, a simulated time or a weight feeds the stride scheduler's passes (`controller/shares.py`): one NaN or
infinity there makes every comparison false and nobody is admitted again. So every such number is checked where it
comes in (the API, the seam, the operator's requests, the command line) by `bounded`, and the scheduler asserts
what it computes from them is finite.
"""

from __future__ import annotations

import math

__all__ = ["bounded", "COST_SECONDS", "WEIGHT", "Bounds"]


class Bounds(tuple):
    """``(low, high)``: a number is taken when ``low <= value <= high`` and finite."""

    def __new__(cls, low: float, high: float):
        return super().__new__(cls, (float(low), float(high)))

    @property
    def low(self) -> float:
        return self[0]

    @property
    def high(self) -> float:
        return self[1]


COST_SECONDS = Bounds(1e-6, 1e6)   # a call's simulated time or cost estimate, in seconds: 1 µs .. 11.6 days
WEIGHT = Bounds(1e-6, 1e6)         # a client's share of device time, relative to the others


def bounded(value, what: str, bounds: Bounds, fix: str = "") -> float:
    """``value`` as a float if it is a finite number within ``bounds``; else a ValueError naming what was expected,
    what came, and ``fix`` (what to do instead)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: expected a number in [{bounds.low:g}, {bounds.high:g}], got "
                         f"{type(value).__name__} {value!r}" + (f"; {fix}" if fix else ""))
    number = float(value)
    if not math.isfinite(number) or not bounds.low <= number <= bounds.high:
        raise ValueError(f"{what}: expected a finite number in [{bounds.low:g}, {bounds.high:g}], got {value!r}"
                         + (f"; {fix}" if fix else ""))
    return number
