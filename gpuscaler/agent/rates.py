"""Rates of counters over a window: a GPU's energy counter (J) as average power (W) between two of its samples.

A rate needs two readings of the counter: over the query's window it is (last - first) / (time between them),
the average over the window by construction (so it takes no window function); without a window it is the
rate over the newest two samples, one poll interval. The agent reduces it from its own ring buffer (``history.py``)
with its own tick times (``taken_at``), and a gateway asks its agents for it as for any window. A counter that
falls restarted (the driver reloaded): only the readings after the restart count. Too few readings is an
absence with its reason, never a 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpuscaler.model.gpu_metrics import METRICS, Metric


@dataclass(frozen=True, slots=True)
class Rate:
    """A rate per second, from ``sample_count`` readings taken from ``first_seconds`` on; or None, and why."""

    value: float | None
    sample_count: int
    reason: str | None = None
    first_seconds: float | None = None  # when its first reading was taken (after the last restart)


def counter_rate(metric: Metric, points: Sequence[tuple[float, float | None]]) -> Rate:
    """The increase per second of a counter read at ``points`` (seconds, reading or None), oldest first."""
    readable: list[tuple[float, float]] = []
    for seconds, value in points:
        if value is not None:
            readable.append((seconds, value))
    start = 0
    for position in range(1, len(readable)):
        if readable[position][1] < readable[position - 1][1]:
            start = position  # the counter restarted: what came before is another count
    segment = readable[start:]
    reading = METRICS[metric].reading
    if len(segment) < 2:
        if start:
            why = f"{reading} restarted (the driver reloaded) and has been read once since"
        elif readable:
            why = f"{reading} has been read once in the window"
        else:
            why = f"{reading} was not read in the window"
        return Rate(
            None,
            len(segment),
            f"{metric.value} is a rate between two readings, and {why}; it has a value from the next tick on",
        )
    (first_seconds, first), (last_seconds, last) = segment[0], segment[-1]
    if last_seconds <= first_seconds:
        return Rate(
            None,
            len(segment),
            f"{metric.value}: the agent's clock did not advance between its readings of {reading} (a clock step)",
        )
    rate = (last - first) / (last_seconds - first_seconds)
    if not math.isfinite(rate):
        return Rate(
            None,
            len(segment),
            f"{metric.value}: {reading} rose by {last - first:g} in {last_seconds - first_seconds:g}s, "
            "a rate past any number",
        )
    return Rate(rate, len(segment), first_seconds=first_seconds)
