"""Per-ScaledObject series: the value KEDA was answered and its target, over the gRPC stack and on a fake clock."""

from __future__ import annotations

import pytest
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from prometheus_client import CollectorRegistry

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.generated.externalscaler import ExternalScalerStub, GetMetricsRequest, ScaledObjectRef
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import Query
from gpuscaler.server.preview import PREVIEW_METADATA
from gpuscaler.server.telemetry import ScalerAnswers
from gpuscaler.signals.outcome import Evaluation, ListedContributions, failed
from tests.server.test_external_scaler import next_tick
from tests.server.test_telemetry import scrape
from tests.waiting import until_result

VALUE = "gpuscaler_scaler_metric_value"
TARGET = "gpuscaler_scaler_metric_target"
ERRORS = "gpuscaler_scaler_metric_errors_total"
DROPPED = "gpuscaler_scaler_answers_dropped_total"


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def parsed(**metadata: str) -> Query:
    """The query KEDA's metadata ``metadata`` asks for."""
    return parse_metadata(metadata, Limits(history_seconds=600.0))


def labels(scaled_object: str, query: Query, namespace: str = "ml") -> dict[str, str]:
    """The per-ScaledObject labels of ``query`` asked for by ScaledObject ``namespace/scaled_object``."""
    return {"namespace": namespace, "scaled_object": scaled_object, "metric_name": query.metric_name}


def sample(answers: ScalerAnswers, name: str, wanted: dict[str, str]) -> float | None:
    """One sample of ``answers``' series, read through a registry as a scrape would."""
    registry = CollectorRegistry()
    registry.register(answers)
    return registry.get_sample_value(name, wanted)


def pushed(query: Query, value: float | None) -> Evaluation:
    """A push evaluation of ``query``: its value, or the error an unreadable GPU makes."""
    if value is None:
        return failed(query.value, None, Unavailable("gpu 0 is lost"))
    return Evaluation(query.value, ListedContributions(), value, None, None)


async def test_a_preview_adds_no_per_scaled_object_series(agent: Agent, channel: Channel) -> None:
    """A preview's GetMetricSpec and GetMetrics leave /metrics without a series for the ScaledObject it names."""
    preview = ExternalScalerStub(channel, metadata=PREVIEW_METADATA)
    scaled = ScaledObjectRef(name="gpuscaler-query", namespace="default", scaler_metadata={"targetValue": "60"})
    [spec] = (await preview.get_metric_spec(scaled)).metric_specs
    await preview.get_metrics(GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec.metric_name))
    series = await scrape(agent)
    assert series.get(VALUE, []) == []
    assert series.get(TARGET, []) == []


async def test_keda_sees_its_value_and_target_per_scaled_object(agent: Agent, channel: Channel) -> None:
    """After GetMetricSpec and GetMetrics, /metrics holds the value answered and the target given, labelled with
    the ScaledObject and metric name, and no errors."""
    fake(agent).set_values(None, {Metric.GPU_UTILIZATION: 45.5})
    await next_tick(agent)
    stub = ExternalScalerStub(channel)
    ref = ScaledObjectRef(name="llm", namespace="ml", scaler_metadata={"targetValue": "60.4"})
    [spec] = (await stub.get_metric_spec(ref)).metric_specs
    [answer] = (await stub.get_metrics(GetMetricsRequest(ref, spec.metric_name))).metric_values

    series = await scrape(agent)
    want = {"namespace": "ml", "scaled_object": "llm", "metric_name": spec.metric_name}
    assert [(s.labels, s.value) for s in series[VALUE]] == [(want, answer.metric_value_float)]
    assert answer.metric_value_float == pytest.approx(4 * 45.5)
    assert [(s.labels, s.value) for s in series[TARGET]] == [(want, 60.4)]
    assert [s.value for s in series[ERRORS]] == [0.0]


async def test_an_error_answer_removes_the_value_and_counts(agent: Agent, channel: Channel) -> None:
    """A GetMetrics that answers UNAVAILABLE (its GPU is lost) leaves no value series, not a 0; the target stays,
    the error counts, and the next good answer brings the value back."""
    stub = ExternalScalerStub(channel)
    ref = ScaledObjectRef(name="llm", namespace="ml", scaler_metadata={"gpuIndex": "1"})
    [spec] = (await stub.get_metric_spec(ref)).metric_specs
    request = GetMetricsRequest(ref, spec.metric_name)
    await stub.get_metrics(request)
    assert len((await scrape(agent))[VALUE]) == 1

    fake(agent).fail(1, Failure.LOST)
    await next_tick(agent)
    with pytest.raises(GRPCError):
        await stub.get_metrics(request)
    series = await scrape(agent)
    assert series.get(VALUE, []) == []
    assert [s.value for s in series[TARGET]] == [spec.target_size_float]
    assert [s.value for s in series[ERRORS]] == [1.0]

    fake(agent).heal(1)
    await next_tick(agent)
    await stub.get_metrics(request)
    assert len((await scrape(agent))[VALUE]) == 1


async def test_a_push_stream_s_evaluations_are_the_value(agent: Agent, channel: Channel) -> None:
    """While KEDA holds a push stream, the value follows the stream's evaluations without any GetMetrics call."""
    collector = fake(agent)
    collector.set_values(None, {Metric.GPU_UTILIZATION: 1.0})
    await next_tick(agent)
    ref = ScaledObjectRef(name="push", namespace="ml", scaler_metadata={"gpuIndex": "0"})
    stream = ExternalScalerStub(channel).stream_is_active(ref)
    assert (await anext(aiter(stream))).result is False

    async def value() -> list[float]:
        return [s.value for s in (await scrape(agent)).get(VALUE, [])]

    assert await until_result(value, lambda values: values == [1.0])
    collector.set_values(0, {Metric.GPU_UTILIZATION: 90.0})
    assert await until_result(value, lambda values: values == [90.0])
    await stream.aclose()  # type: ignore[attr-defined]


def test_the_newer_of_a_poll_and_a_push_is_the_value() -> None:
    """GetMetrics and push evaluations take turns as the value, whichever came last; an unknown push evaluation
    hides the value, and when the stream closes its last evaluation stays."""
    answers = ScalerAnswers(clock=FakeClock())
    query = parsed(gpuIndex="0")
    want = labels("so", query)
    answers.observe_push(query, pushed(query, 5.0))  # no stream holds it: not this ScaledObject's
    answers.observe_value("ml", "so", query, 1.0)
    assert sample(answers, VALUE, want) == 1.0
    answers.stream_opened("ml", "so", query)
    answers.observe_push(query, pushed(query, 2.0))
    assert sample(answers, VALUE, want) == 2.0
    answers.observe_value("ml", "so", query, 3.0)
    assert sample(answers, VALUE, want) == 3.0
    answers.observe_push(query, pushed(query, None))
    assert sample(answers, VALUE, want) is None
    answers.observe_push(query, pushed(query, 4.0))
    answers.stream_closed("ml", "so", query)
    assert sample(answers, VALUE, want) == 4.0


def test_an_entry_keda_stops_asking_about_expires() -> None:
    """Ten minutes after its last call a ScaledObject's series are gone; one with a push stream open stays, and
    ages from the stream's end."""
    clock = FakeClock()
    answers = ScalerAnswers(clock=clock, idle_seconds=600.0)
    polled, streamed = parsed(gpuIndex="0"), parsed(gpuIndex="1")
    answers.observe_value("ml", "polled", polled, 1.0)
    answers.stream_opened("ml", "streamed", streamed)
    clock.now += 599.0
    assert sample(answers, TARGET, labels("polled", polled)) == 70.0
    clock.now += 2.0
    assert sample(answers, TARGET, labels("polled", polled)) is None
    assert sample(answers, ERRORS, labels("polled", polled)) is None
    clock.now += 3600.0
    assert sample(answers, TARGET, labels("streamed", streamed)) == 70.0
    answers.stream_closed("ml", "streamed", streamed)
    clock.now += 599.0
    assert len(answers) == 1
    clock.now += 2.0
    assert sample(answers, TARGET, labels("streamed", streamed)) is None
    assert len(answers) == 0


def test_the_entries_are_capped_and_the_least_recently_asked_goes() -> None:
    """Past max_entries the least recently asked ScaledObject without a stream makes room and counts as dropped;
    when every entry holds a stream the newcomer is the one dropped."""
    answers = ScalerAnswers(clock=FakeClock(), max_entries=3)
    query = parsed()
    answers.stream_opened("ml", "streamed", query)
    for name in ("a", "b"):
        answers.observe_value("ml", name, query, 1.0)
    answers.observe_value("ml", "a", query, 2.0)  # asked again: now b is the oldest
    answers.observe_value("ml", "c", query, 3.0)
    assert len(answers) == 3
    assert sample(answers, VALUE, labels("b", query)) is None
    assert sample(answers, VALUE, labels("a", query)) == 2.0
    assert sample(answers, VALUE, labels("c", query)) == 3.0
    assert sample(answers, DROPPED, {}) == 1.0

    full = ScalerAnswers(clock=FakeClock(), max_entries=1)
    full.stream_opened("ml", "streamed", query)
    full.observe_value("ml", "new", query, 1.0)
    assert len(full) == 1
    assert sample(full, VALUE, labels("new", query)) is None
    assert sample(full, DROPPED, {}) == 1.0


def fake(agent: Agent) -> FakeCollector:
    """The agent's fake collector, to change what its GPUs read."""
    assert isinstance(agent.collector, FakeCollector)
    return agent.collector
