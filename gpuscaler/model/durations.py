"""Durations as people write them in metadata, flags and scenario files: ``500ms``, ``30s``, ``2m``, ``1h``."""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS_PER_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``; a bare number is seconds. Raises ValueError with the allowed forms."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration; use a number with ms, s, m or h, like '30s' or '2m'")
    seconds = float(match.group(1)) * _SECONDS_PER_UNIT[match.group(2) or "s"]
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a finite duration")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest of ``parse_duration``'s forms that reads back as ``seconds``."""
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    if seconds >= 1:
        return f"{seconds:g}s"
    return f"{seconds * 1000:g}ms"
