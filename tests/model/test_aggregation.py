"""aggregate() across GPUs and reduce_window() over one GPU's samples: plain number tables."""

from __future__ import annotations

import pytest

from gpuscaler.model.aggregation import Aggregation, WindowFunction, aggregate, percentile, reduce_window

FOUR = [10.0, 20.0, 30.0, 40.0]


@pytest.mark.parametrize(
    ("aggregation", "values", "expected"),
    [
        pytest.param(Aggregation.MAX, FOUR, 40.0, id="max"),
        pytest.param(Aggregation.MIN, FOUR, 10.0, id="min"),
        pytest.param(Aggregation.AVG, FOUR, 25.0, id="avg"),
        pytest.param(Aggregation.SUM, FOUR, 100.0, id="sum"),
        pytest.param(Aggregation.MEDIAN, FOUR, 25.0, id="median-even"),
        pytest.param(Aggregation.MEDIAN, [10.0, 20.0, 90.0], 20.0, id="median-odd"),
        pytest.param(Aggregation.P90, FOUR, 37.0, id="p90-type7"),
        pytest.param(Aggregation.P95, FOUR, 38.5, id="p95-type7"),
        pytest.param(Aggregation.P99, FOUR, 39.7, id="p99-type7"),
        pytest.param(Aggregation.P90, [0.0, 100.0], 90.0, id="p90-two"),
        pytest.param(Aggregation.P99, [float(v) for v in range(101)], 99.0, id="p99-on-a-rank"),
        pytest.param(Aggregation.MAX, [40.0, 10.0, 30.0, 20.0], 40.0, id="max-unsorted"),
        pytest.param(Aggregation.MIN, [40.0, 10.0, 30.0, 20.0], 10.0, id="min-unsorted"),
        pytest.param(Aggregation.MEDIAN, [40.0, 10.0, 30.0, 20.0], 25.0, id="median-unsorted"),
        pytest.param(Aggregation.P90, [40.0, 10.0, 30.0, 20.0], 37.0, id="p90-unsorted"),
        pytest.param(Aggregation.P95, [30.0, 40.0, 10.0, 20.0], 38.5, id="p95-unsorted"),
        pytest.param(Aggregation.SUM, [0.0, 0.0], 0.0, id="sum-of-idle"),
        pytest.param(Aggregation.AVG, [0.0, 100.0, 50.0], 50.0, id="avg-three"),
    ],
)
def test_aggregate(aggregation: Aggregation, values: list[float], expected: float) -> None:
    """Each aggregation combines GPUs' values as documented; percentiles interpolate linearly (type 7)."""
    assert aggregate(aggregation, values) == pytest.approx(expected)


@pytest.mark.parametrize("aggregation", list(Aggregation), ids=str)
def test_aggregate_of_one_value_is_that_value(aggregation: Aggregation) -> None:
    """With one GPU, every aggregation (percentiles included) returns its value."""
    assert aggregate(aggregation, [42.5]) == 42.5


@pytest.mark.parametrize("aggregation", list(Aggregation), ids=str)
def test_aggregate_does_not_reorder_its_input(aggregation: Aggregation) -> None:
    """Aggregating leaves the caller's list as it was."""
    values = [40.0, 10.0, 30.0]
    aggregate(aggregation, values)
    assert values == [40.0, 10.0, 30.0]


def test_sum_of_many_decimals_does_not_drift() -> None:
    """Summing many per-GPU values is exact to the float, so the HPA's ceil() does not round up a drift."""
    assert aggregate(Aggregation.SUM, [0.1] * 10) == 1.0


@pytest.mark.parametrize("aggregation", list(Aggregation), ids=str)
def test_aggregate_of_nothing_raises(aggregation: Aggregation) -> None:
    """No values is an error, never 0 (a 0 would scale the workload in)."""
    with pytest.raises(ValueError, match="nothing to aggregate"):
        aggregate(aggregation, [])


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        pytest.param(0.0, 10.0, id="p0-is-min"),
        pytest.param(100.0, 40.0, id="p100-is-max"),
        pytest.param(50.0, 25.0, id="p50"),
        pytest.param(90.0, 37.0, id="p90"),
        pytest.param(100.0 / 3.0, 20.0, id="exact-rank"),
    ],
)
def test_percentile_interpolates_between_ranks(q: float, expected: float) -> None:
    """percentile() interpolates between the two nearest ranks, ends included."""
    assert percentile(FOUR, q) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("function", "values", "expected"),
    [
        pytest.param(WindowFunction.AVG, [3.0, 9.0, 6.0], 6.0, id="avg"),
        pytest.param(WindowFunction.MAX, [3.0, 9.0, 6.0], 9.0, id="max"),
        pytest.param(WindowFunction.MIN, [3.0, 9.0, 6.0], 3.0, id="min"),
        pytest.param(WindowFunction.LAST, [3.0, 9.0, 6.0], 6.0, id="last-is-newest"),
        pytest.param(WindowFunction.LAST, [6.0, 9.0, 3.0], 3.0, id="last-not-min"),
        pytest.param(WindowFunction.AVG, [10.0] * 9 + [100.0], 19.0, id="avg-of-a-spike"),
        pytest.param(WindowFunction.MAX, [10.0] * 9 + [100.0], 100.0, id="max-of-a-spike"),
    ],
)
def test_reduce_window(function: WindowFunction, values: list[float], expected: float) -> None:
    """Each window function reduces one GPU's samples, given oldest first."""
    assert reduce_window(function, values) == pytest.approx(expected)


@pytest.mark.parametrize("function", list(WindowFunction), ids=str)
def test_reduce_window_of_one_sample_is_that_sample(function: WindowFunction) -> None:
    """A window holding one sample reduces to it."""
    assert reduce_window(function, [7.5]) == 7.5


@pytest.mark.parametrize("function", list(WindowFunction), ids=str)
def test_reduce_window_of_nothing_raises(function: WindowFunction) -> None:
    """An empty window is an error, never 0."""
    with pytest.raises(ValueError, match="nothing to reduce"):
        reduce_window(function, [])
