"""Reducing numbers: a GPU's samples over a window, then GPUs into one value. Pure functions and their names.

Percentiles (median, p90, p95, p99) interpolate linearly between the two nearest ranks
(Hyndman & Fan type 7, numpy's default): p90 of [10, 20, 30, 40] is 37.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence


class Aggregation(enum.StrEnum):
    """How the selected GPUs' values combine into the one value KEDA gets."""

    MAX = "max"
    MIN = "min"
    AVG = "avg"
    SUM = "sum"
    MEDIAN = "median"
    P90 = "p90"
    P95 = "p95"
    P99 = "p99"


class WindowFunction(enum.StrEnum):
    """How one GPU's samples inside the window reduce to one value, before GPUs are combined."""

    AVG = "avg"
    MAX = "max"
    MIN = "min"
    LAST = "last"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of a non-empty sequence, by linear interpolation."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


_AGGREGATIONS: dict[Aggregation, Callable[[Sequence[float]], float]] = {
    Aggregation.MAX: max,
    Aggregation.MIN: min,
    Aggregation.AVG: _mean,
    Aggregation.SUM: math.fsum,
    Aggregation.MEDIAN: lambda values: percentile(values, 50),
    Aggregation.P90: lambda values: percentile(values, 90),
    Aggregation.P95: lambda values: percentile(values, 95),
    Aggregation.P99: lambda values: percentile(values, 99),
}

_WINDOW_FUNCTIONS: dict[WindowFunction, Callable[[Sequence[float]], float]] = {
    WindowFunction.AVG: _mean,
    WindowFunction.MAX: max,
    WindowFunction.MIN: min,
    WindowFunction.LAST: lambda values: values[-1],
}


def aggregate(aggregation: Aggregation, values: Sequence[float]) -> float:
    """Combine GPUs' values; ``values`` must not be empty (no data is an error, never 0)."""
    if not values:
        raise ValueError("nothing to aggregate")
    return _AGGREGATIONS[aggregation](values)


def reduce_window(function: WindowFunction, values_oldest_first: Sequence[float]) -> float:
    """Reduce one GPU's samples inside a window; ``values_oldest_first`` must not be empty."""
    if not values_oldest_first:
        raise ValueError("nothing to reduce")
    return _WINDOW_FUNCTIONS[function](values_oldest_first)
