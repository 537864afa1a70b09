"""No answer carries a value that is not a finite number, or one past its signal's bound: the pod is named instead."""

from __future__ import annotations

import math

import pytest

from gpuscaler.agent.rates import counter_rate
from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.engines import ENGINE_SIGNALS, EngineMetric, EnginePage, PodScrape
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.query import (
    CombinedQuery,
    EngineQuery,
    GpuQuery,
    GpuSelection,
    PodSelection,
    SignalTarget,
    SingleQuery,
)
from gpuscaler.signals.combined import evaluate_combined
from gpuscaler.signals.engines.values import signal_value
from gpuscaler.signals.outcome import Evaluation, ListedContributions

RATE = ENGINE_SIGNALS[EngineMetric.TRITON_REQUEST_RATE]
WAIT = ENGINE_SIGNALS[EngineMetric.TRITON_QUEUE_WAIT]
SUCCESS = "nv_inference_request_success"
QUEUE_US = "nv_inference_queue_duration_us"


def scrape(before: dict[str, float], after: dict[str, float], seconds: float = 1.0) -> PodScrape:
    """Two pages of one pod, ``seconds`` apart."""
    return PodScrape("http://10.0.0.1:8002/metrics", EnginePage(10.0 + seconds, after), EnginePage(10.0, before))


def test_a_rate_past_its_bound_names_the_pod_and_the_bound() -> None:
    """A request rate of 1e12 a second is past the bound a pod can read: the pod is unread, the bound named."""
    value = signal_value(RATE, scrape({SUCCESS: 0.0}, {SUCCESS: 1e12}), now=11.0, stale_after=5.0)
    assert isinstance(value, str)
    assert value.startswith("http://10.0.0.1:8002/metrics: its rate of nv_inference_request_success is 1e+12")
    assert "past the 1e+07 requests/s" in value


def test_a_rate_that_overflows_is_no_answer() -> None:
    """An increase of 1.7e308 over a millisecond is infinite per second: no answer, never infinity."""
    value = signal_value(RATE, scrape({SUCCESS: 0.0}, {SUCCESS: 1.7e308}, 0.001), now=11.0, stale_after=5.0)
    assert isinstance(value, str)
    assert "is inf, which no engine reports" in value


def test_a_ratio_within_its_bound_is_the_answer() -> None:
    """Triton's queue wait of 2 ms a request is well within its bound and answered as read."""
    pages = scrape({SUCCESS: 0.0, QUEUE_US: 0.0}, {SUCCESS: 10.0, QUEUE_US: 20_000.0})
    assert signal_value(WAIT, pages, now=11.0, stale_after=5.0) == pytest.approx(2.0)


def test_an_evaluation_of_infinity_becomes_unavailable() -> None:
    """An evaluation made with an infinite value holds an UNAVAILABLE error instead, whatever made it."""
    query = GpuQuery(Metric.POWER_AVERAGE, Aggregation.SUM, GpuSelection(), None, WindowFunction.AVG)
    evaluation = Evaluation(query, ListedContributions(()), math.inf, None, None)
    assert evaluation.value is None
    assert isinstance(evaluation.error, Unavailable)
    assert "the value is inf, not a number" in evaluation.error.message


def test_a_combined_value_over_a_tiny_target_that_overflows_is_unavailable() -> None:
    """A signal's value over its target that overflows makes the combined answer UNAVAILABLE, naming the signal."""
    queue = EngineQuery(EngineMetric.VLLM_QUEUE, PodSelection(namespace="ml", workload="llm"), Aggregation.SUM)

    def evaluate(single: SingleQuery) -> Evaluation:
        return Evaluation(single, ListedContributions(()), 1e300, None, None)

    combined = evaluate_combined(CombinedQuery((SignalTarget(queue, 1e-300),)), evaluate)
    assert combined.value is None
    assert isinstance(combined.error, Unavailable)
    assert combined.error.message.startswith("signal vllm_queue: its value over its target 1e-300 is inf")


def test_a_gpu_counter_rate_that_overflows_has_a_reason() -> None:
    """A GPU counter that rose past the float range in a second has no rate, and says why."""
    rate = counter_rate(Metric.POWER_AVERAGE, [(0.0, 0.0), (1e-300, 1e10)])
    assert rate.value is None
    assert rate.reason is not None
    assert "a rate past any number" in rate.reason
