"""Durations as people write them in metadata, flags and scenario files: ``500ms``, ``30s``, ``2m``, ``1m30s``.

Go's and Prometheus' way, which KEDA's users already write: a number and a unit, or several such terms from the
largest unit down (``1h30m``), in lower case, without spaces or a sign. A number alone is refused rather than read
as seconds: ``window: "30"`` could as well mean minutes, and every other duration a ScaledObject holds has a unit.
"""

from __future__ import annotations

import decimal
import math
import re

_SECONDS_PER_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}  # largest first: the order terms come in
_NUMBER = r"\d+(?:\.\d+)?"
_TERM = re.compile(rf"({_NUMBER})(ms|s|m|h)")
_DURATION = re.compile(rf"(?:{_NUMBER}(?:ms|s|m|h))+")
ALLOWED = "a number and a unit (ms, s, m or h), like '500ms', '30s', '2m' or '1m30s'"


class DurationError(ValueError):
    """``parse_duration``'s refusal. Its message is the text quoted, then ``problem``: what is wrong and what to
    write instead, a predicate that reads on from whatever names the text (``window '30' has no unit; ...``)."""

    def __init__(self, text: str, problem: str) -> None:
        super().__init__(f"{text!r} {problem}")
        self.problem = problem


def parse_duration(text: str) -> float:
    """Seconds in ``text``. Raises DurationError, whose message starts with ``repr(text)`` so that a caller can put
    the key in front of it, or whose ``problem`` a caller puts after its own words for the text (a flag does)."""
    stripped = text.strip()
    problem = _problem(stripped)
    if problem is not None:
        raise DurationError(text, problem)
    terms = [(float(number), unit) for number, unit in _TERM.findall(stripped)]
    order = list(_SECONDS_PER_UNIT)
    positions = [order.index(unit) for _, unit in terms]
    if positions != sorted(set(positions)):
        raise DurationError(
            text, "repeats a unit or puts a smaller one first; write each unit once, largest first, like '1m30s'"
        )
    seconds = sum(number * _SECONDS_PER_UNIT[unit] for number, unit in terms)
    if not math.isfinite(seconds):
        raise DurationError(text, "is too long to be a duration")
    return seconds


def _problem(stripped: str) -> str | None:
    """What is wrong with ``stripped`` as a duration, as a predicate; None when it has the form of one."""
    if _DURATION.fullmatch(stripped):
        return None
    if not stripped:
        return f"is empty; write {ALLOWED}"
    if stripped.startswith("-"):
        positive = stripped.lstrip("-")
        like = f", like {positive!r}" if _DURATION.fullmatch(positive) else ""
        return f"is negative; a duration must be positive{like}"
    if re.fullmatch(_NUMBER, stripped):
        return f"has no unit; write '{stripped}s' for seconds, or another unit (ms, m, h)"
    if re.search(r"\d[eE][+-]?\d", stripped):
        one = re.fullmatch(rf"({_NUMBER}[eE][+-]?\d+)(ms|s|m|h)", stripped)
        number = decimal.Decimal(one[1]) if one else None
        written = f"{number:f}{one[2]}" if one and number is not None and abs(number.adjusted()) <= 20 else None
        return "has an exponent; write the number out" + (f", like {written!r}" if written else f": {ALLOWED}")
    compact = re.sub(r"\s+", "", stripped)
    if compact != stripped and _DURATION.fullmatch(compact):
        return f"has a space in it; write {compact!r}"
    if _DURATION.fullmatch(stripped.lower()):
        return f"has an upper-case unit; write {stripped.lower()!r}"
    return f"is not a duration; write {ALLOWED}"


def format_duration(seconds: float) -> str:
    """The shortest of ``parse_duration``'s one-term forms that reads back as ``seconds``."""
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    if seconds >= 1:
        return f"{_decimal(seconds)}s"
    return f"{_decimal(seconds * 1000)}ms"


def _decimal(number: float) -> str:
    """``number`` without an exponent (which ``parse_duration`` refuses), to the microsecond."""
    return f"{number:.6f}".rstrip("0").rstrip(".")
