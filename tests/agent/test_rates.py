"""power_average: a GPU's energy counter as average watts over the window, or over its newest two samples."""

from __future__ import annotations

import pytest

from gpuscaler.agent.history import History
from gpuscaler.agent.rates import counter_rate
from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.errors import InvalidMetadata, Unavailable, Unsupported
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import ReadError, ReadErrorKind
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import GpuQuery, GpuSelection
from gpuscaler.signals.evaluation import evaluate
from tests.builders import gpu_sample, history_of, snapshot


def power_average(window: float | None = None) -> GpuQuery:
    """power_average summed over every GPU, over ``window`` seconds (None: each GPU's newest two samples)."""
    return GpuQuery(Metric.POWER_AVERAGE, Aggregation.SUM, GpuSelection(), window, WindowFunction.AVG)


def energy_history(*per_tick: tuple[float | None, ...], interval: float = 1.0) -> History:
    """One snapshot per tick, ``interval`` s apart, with each GPU's energy counter in joules."""
    return history_of(
        *(
            snapshot(i + 1, i * interval, tuple(gpu_sample(g, energy=e) for g, e in enumerate(energies)))
            for i, energies in enumerate(per_tick)
        )
    )


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        pytest.param([(0.0, 100.0), (1.0, 400.0)], 300.0, id="two-readings"),
        pytest.param([(0.0, 100.0), (0.5, 300.0), (2.0, 700.0)], 300.0, id="first-and-last-of-the-window"),
        pytest.param([(0.0, 100.0), (1.0, None), (2.0, 500.0)], 200.0, id="an-unread-tick-in-between"),
        pytest.param([(0.0, 9e9), (1.0, 50.0), (3.0, 450.0)], 200.0, id="after-a-counter-restart"),
        pytest.param([(0.0, 10.0), (1.0, 10.0)], 0.0, id="a-real-zero-from-two-equal-readings"),
    ],
)
def test_counter_rate(points: list[tuple[float, float | None]], expected: float) -> None:
    """The rate is (last - first) / time between them, over the readable readings after the last restart."""
    rate = counter_rate(Metric.POWER_AVERAGE, points)
    assert rate.value == pytest.approx(expected)
    assert rate.reason is None


@pytest.mark.parametrize(
    ("points", "fragment"),
    [
        pytest.param([(0.0, 100.0)], "read once in the window", id="one-reading"),
        pytest.param([(0.0, None), (1.0, None)], "not read in the window", id="none"),
        pytest.param([(0.0, 500.0), (1.0, 10.0)], "restarted", id="restart-leaves-one"),
        pytest.param([(5.0, 100.0), (5.0, 200.0)], "clock", id="no-time-passed"),
    ],
)
def test_counter_rate_without_two_readings_is_absent_with_its_reason(
    points: list[tuple[float, float | None]], fragment: str
) -> None:
    """Too few readings is no value with a reason that names the counter, never 0."""
    rate = counter_rate(Metric.POWER_AVERAGE, points)
    assert rate.value is None
    assert rate.reason is not None
    assert fragment in rate.reason


def test_without_a_window_it_is_the_last_poll_interval() -> None:
    """No window: each GPU's rate between its newest two samples, then the sum over GPUs."""
    history = energy_history((0.0, 0.0), (100.0, 50.0), (400.0, 60.0), interval=1.0)
    evaluation = evaluate(power_average(), history, now=2.0, stale_after=3.0)
    assert [c.value for c in evaluation.contributions] == [300.0, 10.0]
    assert evaluation.value_or_raise() == pytest.approx(310.0)
    assert [c.sample_count for c in evaluation.contributions] == [2, 2]


def test_over_a_window_it_is_the_average_over_the_window() -> None:
    """With a window, a burst inside it counts in full: (last - first) / elapsed."""
    history = energy_history((0.0,), (100.0,), (900.0,), (1000.0,), (1100.0,), interval=1.0)
    evaluation = evaluate(power_average(window=4.0), history, now=4.0, stale_after=3.0)
    assert evaluation.value_or_raise() == pytest.approx(275.0)
    [contribution] = evaluation.contributions
    assert contribution.sample_count == 5


def test_the_first_tick_has_no_rate_and_the_query_waits_instead_of_reading_zero() -> None:
    """With one snapshot there is no rate: the GPU is left out with the reason, and the answer is UNAVAILABLE."""
    evaluation = evaluate(power_average(), energy_history((500.0,)), now=0.0, stale_after=3.0)
    assert isinstance(evaluation.error, Unavailable)
    assert "power_average is a rate between two readings" in evaluation.error.message
    assert evaluation.value is None


def test_an_unsupported_counter_is_unsupported() -> None:
    """A GPU without an energy counter (NOT_SUPPORTED, a MIG instance) makes power_average FAILED_PRECONDITION."""
    error = ReadError("energy_joules", ReadErrorKind.NOT_SUPPORTED, "energy is counted per physical GPU")
    history = history_of(
        snapshot(1, 0.0, (gpu_sample(0, errors=(error,)),)), snapshot(2, 1.0, (gpu_sample(0, errors=(error,)),))
    )
    evaluation = evaluate(power_average(), history, now=1.0, stale_after=3.0)
    assert isinstance(evaluation.error, Unsupported)
    assert "per physical GPU" in evaluation.error.message


@pytest.mark.parametrize("function", ["max", "min", "last"])
def test_a_window_function_other_than_avg_is_refused(function: str) -> None:
    """power_average is an average by definition: another windowFunction is INVALID_ARGUMENT naming the way out."""
    with pytest.raises(InvalidMetadata) as raised:
        parse_metadata(
            {"metric": "power_average", "window": "1m", "windowFunction": function}, Limits(history_seconds=600)
        )
    assert f"windowFunction '{function}' does not apply to power_average" in raised.value.message
    assert "power_draw" in raised.value.message
