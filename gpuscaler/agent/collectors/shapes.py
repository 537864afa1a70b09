"""A fake GPU's value over time: constant, or a sine, square, triangle or ramp, seconds after the agent started."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class Shape(Protocol):
    """A value over time: what a fake GPU reads for one metric, seconds after the agent started."""

    def at(self, seconds: float) -> float:
        """The value ``seconds`` after the start."""


@dataclass(frozen=True, slots=True)
class Constant:
    """The same value at every moment (what ``fake set`` and a plain number in a scenario give)."""

    value: float

    def at(self, seconds: float) -> float:
        return self.value


@dataclass(frozen=True, slots=True)
class Sine:
    """A sine wave between ``low`` and ``high`` with a ``period`` in seconds, shifted by ``phase`` seconds."""

    low: float
    high: float
    period: float
    phase: float = 0.0

    def at(self, seconds: float) -> float:
        middle, amplitude = (self.high + self.low) / 2, (self.high - self.low) / 2
        return middle + amplitude * math.sin(2 * math.pi * (seconds + self.phase) / self.period)


@dataclass(frozen=True, slots=True)
class Square:
    """``high`` for the first half of each ``period`` seconds, ``low`` for the second half."""

    low: float
    high: float
    period: float

    def at(self, seconds: float) -> float:
        return self.high if (seconds % self.period) < self.period / 2 else self.low


@dataclass(frozen=True, slots=True)
class Triangle:
    """A straight rise from ``low`` to ``high`` and back down again, once every ``period`` seconds."""

    low: float
    high: float
    period: float

    def at(self, seconds: float) -> float:
        position = (seconds % self.period) / self.period
        rise = 2 * position if position < 0.5 else 2 * (1 - position)
        return self.low + (self.high - self.low) * rise


@dataclass(frozen=True, slots=True)
class Ramp:
    """A straight line from ``start`` to ``end`` over ``duration`` seconds, then holding at ``end``."""

    start: float
    end: float
    duration: float

    def at(self, seconds: float) -> float:
        progress = min(max(seconds / self.duration, 0.0), 1.0)
        return self.start + (self.end - self.start) * progress
