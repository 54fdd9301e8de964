"""A policy's knobs, declared once beside the policy: name, type, range, default. The registry
validates every request for a policy against them (the library's make_policy and the HTTP
endpoint alike), so a new policy's knobs are checked the day it is registered."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

# A step drafts and verifies on the order of a policy's integer knobs (k, depth, gamma ...);
# beyond this one request could monopolise a replica or exhaust its memory.
MAX_STEP_KNOB = 64


def describe(value: Any) -> str:
    """``float 2.5``: the type and a short repr, for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range, e.g. 10**400 from JSON
        return False


class KnobError(ValueError):
    """A knob value a policy refuses; ``knob`` names it (None: the set of knobs is wrong)."""

    def __init__(self, message: str, knob: str | None = None) -> None:
        super().__init__(message)
        self.knob = knob


@dataclass(frozen=True)
class Knob:
    """One knob. ``low``/``high`` bound it (``low_open``: strictly above ``low``); a knob whose
    default is None takes its value from the policy's artifacts (``help`` says which)."""

    name: str
    type: type  # int, float or bool
    default: Any
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    help: str = ""
    title: str | None = None  # what messages call it, when not its name (lam -> lambda)

    def type_error(self, value: Any) -> str | None:
        """Why ``value`` has the wrong type for this knob, or None. Integers are accepted for
        float knobs; booleans only for bool knobs."""
        if self.type is bool:
            ok = isinstance(value, bool)
            want = "a boolean"
        elif self.type is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            want = "an integer"
        else:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            want = "a number"
            if ok and not _finite(value):
                return f"knob '{self.name}' must be finite, got {describe(value)}"
        return None if ok else f"knob '{self.name}' must be {want}, got {describe(value)}"

    def range_error(self, value: Any) -> str | None:
        """Why ``value`` (of the right type) is out of range, or None."""
        if self.type is bool:
            return None
        label = self.title or self.name
        if self.low is not None:
            if self.low_open and not value > self.low:
                return f"{label} must be > {self.low:g}, got {value}"
            if not self.low_open and value < self.low:
                return f"{label} must be >= {self.low:g}, got {value}"
        if self.high is not None and value > self.high:
            return f"{label} must be <= {self.high:g}, got {value}"
        return None

    def convert(self, value: Any) -> Any:
        return float(value) if self.type is float else self.type(value)


def step_knob(name: str, default: int | None, help: str) -> Knob:
    """An integer knob sizing a step's drafting or verification: 1 .. MAX_STEP_KNOB."""
    return Knob(name, int, default, 1, MAX_STEP_KNOB, help=help)
