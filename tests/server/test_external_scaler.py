"""KEDA's ExternalScaler over a real socket, in-process, with fake GPUs and our grpclib client."""

from __future__ import annotations

import asyncio
import math

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.generated.externalscaler import ExternalScalerStub, GetMetricsRequest, ScaledObjectRef
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.server.preview import PREVIEW_METADATA
from gpuscaler.server.transport.calls import MAX_RECEIVE_MESSAGE_BYTES
from gpuscaler.signals import evaluator as evaluator_module
from tests.conftest import StartAgent
from tests.waiting import until, until_result


def ref(**metadata: str) -> ScaledObjectRef:
    """A ScaledObjectRef named app in namespace ml, with ``metadata`` as its trigger's."""
    return ScaledObjectRef(name="app", namespace="ml", scaler_metadata=metadata)


def fake(agent: Agent) -> FakeCollector:
    """The agent's FakeCollector, to set values and failures on."""
    assert isinstance(agent.collector, FakeCollector)
    return agent.collector


async def next_tick(agent: Agent) -> None:
    """Wait for a snapshot whose reads began after now, so it holds every change made before the call."""
    now = agent.evaluator.now()
    history = agent.evaluator.source
    while True:
        latest = history.latest
        assert latest is not None
        if latest.monotonic >= now:
            return
        await history.wait_newer(latest.sequence)


async def test_spec_then_metrics_then_active_like_keda(agent: Agent, channel: Channel) -> None:
    """KEDA's loop: GetMetricSpec names the metric, GetMetrics with that name answers, IsActive decides."""
    fake(agent).set_values(None, {Metric.GPU_UTILIZATION: 45.5})
    await next_tick(agent)
    stub = ExternalScalerStub(channel)
    scaled = ref(metric="gpu_utilization", targetValue="60.4")

    spec = (await stub.get_metric_spec(scaled)).metric_specs
    assert len(spec) == 1
    assert spec[0].metric_name == "gpuscaler-gpu_utilization-sum"
    assert (spec[0].target_size_float, spec[0].target_size) == (60.4, 60)

    metrics = await stub.get_metrics(GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec[0].metric_name))
    [value] = metrics.metric_values
    assert value.metric_value_float == pytest.approx(4 * 45.5)
    assert value.metric_value == 182  # both fields: KEDA before 2.17 reads only the int

    assert (await stub.is_active(scaled)).result is True


async def test_metric_name_is_matched_case_insensitively(agent: Agent, channel: Channel) -> None:
    """GetMetrics accepts the spec's name in any case and refuses another name with NOT_FOUND naming it."""
    stub = ExternalScalerStub(channel)
    scaled = ref(metricName="my-gpus")
    answer = await stub.get_metrics(GetMetricsRequest(scaled_object_ref=scaled, metric_name="MY-GPUS"))
    assert answer.metric_values[0].metric_name == "my-gpus"

    with pytest.raises(GRPCError) as raised:
        await stub.get_metrics(GetMetricsRequest(scaled_object_ref=scaled, metric_name="other"))
    assert raised.value.status is Status.NOT_FOUND
    assert "'my-gpus'" in (raised.value.message or "")


@pytest.mark.parametrize(
    ("metadata", "names"),
    [
        ({"activationTreshold": "5"}, ["activationTreshold", "activationThreshold"]),
        ({"targetValue": "NaN"}, ["targetValue", "NaN"]),
        ({"aggregation": "mode"}, ["aggregation", "mode", "p95"]),
        ({"gpuIndex": "9"}, ["gpuIndex", "9", "0, 1, 2, 3"]),
    ],
    ids=["typo", "nan-target", "bad-aggregation", "index-not-on-node"],
)
async def test_bad_metadata_is_invalid_argument_naming_the_field(
    agent: Agent, channel: Channel, metadata: dict[str, str], names: list[str]
) -> None:
    """Every RPC refuses bad metadata with INVALID_ARGUMENT and a message naming key, value and choices."""
    stub = ExternalScalerStub(channel)
    calls = [
        stub.is_active(ref(**metadata)),
        stub.get_metrics(
            GetMetricsRequest(scaled_object_ref=ref(**metadata), metric_name="gpuscaler-gpu_utilization-sum-gpu9")
        ),
    ]
    if "gpuIndex" not in metadata:  # the spec does not read GPUs, so a missing GPU is not its error
        calls.append(stub.get_metric_spec(ref(**metadata)))
    for call in calls:
        with pytest.raises(GRPCError) as raised:
            await call
        assert raised.value.status is Status.INVALID_ARGUMENT
        for name in names:
            assert name in (raised.value.message or "")


async def test_lost_gpu_is_unavailable_not_zero(agent: Agent, channel: Channel) -> None:
    """A query over a lost GPU fails UNAVAILABLE naming it; one over the others still answers."""
    fake(agent).fail(2, Failure.LOST)
    await next_tick(agent)
    stub = ExternalScalerStub(channel)

    with pytest.raises(GRPCError) as raised:
        await stub.is_active(ref(gpuIndex="2"))
    assert raised.value.status is Status.UNAVAILABLE
    assert "GPU 2 (GPU-fake-test-node-2)" in (raised.value.message or "")
    assert "gpu_lost" in (raised.value.message or "")

    assert (await stub.is_active(ref(gpuIndex="0,1"))).result is False


async def test_unsupported_metric_is_failed_precondition(agent: Agent, channel: Channel) -> None:
    """A metric the selected GPU cannot report is FAILED_PRECONDITION, which waiting will not fix."""
    fake(agent).fail(1, Failure.NOT_SUPPORTED)
    await next_tick(agent)
    stub = ExternalScalerStub(channel)
    scaled = ref(gpuIndex="1", metric="power_draw")
    with pytest.raises(GRPCError) as raised:
        await stub.get_metrics(GetMetricsRequest(scaled_object_ref=scaled, metric_name="gpuscaler-power_draw-sum-gpu1"))
    assert raised.value.status is Status.FAILED_PRECONDITION
    assert "power_draw cannot be read on GPU 1" in (raised.value.message or "")


async def test_stream_sends_state_at_once_then_only_transitions(agent: Agent, channel: Channel) -> None:
    """StreamIsActive sends the current state on open, then one message per transition and none between."""
    stub = ExternalScalerStub(channel)
    collector = fake(agent)
    received: list[bool] = []
    stream = stub.stream_is_active(ref(metric="gpu_utilization", activationThreshold="50", gpuIndex="0"))

    async def read() -> None:
        async for message in stream:
            received.append(message.result)

    reader = asyncio.create_task(read())
    try:
        await until(lambda: received == [False])
        for _ in range(3):
            await next_tick(agent)
        assert received == [False]  # state holds: nothing sent

        collector.set_values(0, {Metric.GPU_UTILIZATION: 80.0})
        await until(lambda: received == [False, True])
        collector.set_values(0, {Metric.GPU_UTILIZATION: 90.0})
        for _ in range(3):
            await next_tick(agent)
        assert received == [False, True]

        collector.set_values(0, {Metric.GPU_UTILIZATION: 10.0})
        await until(lambda: received == [False, True, False])
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_hysteresis_keeps_active_between_thresholds(agent: Agent, channel: Channel) -> None:
    """Between deactivationThreshold and activationThreshold the previous state holds."""
    stub = ExternalScalerStub(channel)
    collector = fake(agent)
    scaled = ref(metric="gpu_utilization", gpuIndex="0", activationThreshold="50", deactivationThreshold="20")
    for value, expected in [(30.0, False), (60.0, True), (30.0, True), (20.0, False), (30.0, False)]:
        collector.set_values(0, {Metric.GPU_UTILIZATION: value})
        await next_tick(agent)
        assert (await stub.is_active(scaled)).result is expected, value


async def test_a_preview_push_waits_for_a_known_value_only_so_long(
    agent: Agent, channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preview of StreamIsActive of a GPU whose value stays unknown (lost) waits at most the cap (made short
    here), then is UNAVAILABLE saying what it waited for; within a shorter call deadline, that deadline bounds it."""
    fake(agent).fail(0, Failure.LOST)
    await next_tick(agent)
    monkeypatch.setattr(evaluator_module, "FIRST_PUSH_WAIT_SECONDS", 0.05)
    monkeypatch.setattr(evaluator_module, "FIRST_PUSH_POLLS", 0)
    preview = ExternalScalerStub(channel, metadata=PREVIEW_METADATA)
    async with asyncio.timeout(5):  # a guard only: without a bound, the preview waits for good
        with pytest.raises(GRPCError) as raised:
            [message async for message in preview.stream_is_active(ref(gpuIndex="0"))]
    assert raised.value.status is Status.UNAVAILABLE
    assert "no known value of gpuscaler-gpu_utilization-sum-gpu0 within 0.05 s" in (raised.value.message or "")
    assert "GPU 0" in (raised.value.message or "")  # why the value is unknown

    monkeypatch.setattr(evaluator_module, "FIRST_PUSH_WAIT_SECONDS", 60.0)
    query = agent.evaluator.parse({"gpuIndex": "0"}, "ml", "app")
    with pytest.raises(Unavailable, match=r"within 0\.02 s"):
        await agent.evaluator.first_push(query, time_left=0.02)


async def test_a_preview_answers_as_keda_would_and_moves_no_activation_state(agent: Agent, channel: Channel) -> None:
    """`gpuscaler query`'s calls (marked as a preview) at 60% answer what KEDA would get, active; they leave the
    hysteresis as found, so KEDA's own IsActive at 30% still reads inactive. KEDA's at 60% does move it."""
    stub = ExternalScalerStub(channel)
    preview = ExternalScalerStub(channel, metadata=PREVIEW_METADATA)
    collector = fake(agent)
    scaled = ref(metric="gpu_utilization", gpuIndex="0", activationThreshold="50", deactivationThreshold="20")
    name = (await preview.get_metric_spec(scaled)).metric_specs[0].metric_name
    collector.set_values(0, {Metric.GPU_UTILIZATION: 60.0})
    await next_tick(agent)
    assert (await preview.is_active(scaled)).result is True
    [value] = (await preview.get_metrics(GetMetricsRequest(scaled_object_ref=scaled, metric_name=name))).metric_values
    assert value.metric_value_float == 60.0
    async with asyncio.timeout(10):  # the first message KEDA's stream would get, then the end (KEDA's stays open)
        assert [message.result async for message in preview.stream_is_active(scaled)] == [True]

    collector.set_values(0, {Metric.GPU_UTILIZATION: 30.0})
    await next_tick(agent)
    assert (await stub.is_active(scaled)).result is False  # first sight at 30%: nothing made it active
    collector.set_values(0, {Metric.GPU_UTILIZATION: 60.0})
    await next_tick(agent)
    assert (await stub.is_active(scaled)).result is True
    collector.set_values(0, {Metric.GPU_UTILIZATION: 30.0})
    await next_tick(agent)
    assert (await preview.is_active(scaled)).result is True  # KEDA's state, as it is: active holds above 20%
    assert (await stub.is_active(scaled)).result is True


async def test_streams_end_ok_on_stop(start_agent: StartAgent) -> None:
    """Stopping the agent ends every open stream with status OK, so KEDA reconnects after 2 s."""
    agent = await start_agent("--poll-interval", "0.1")
    channel = Channel("127.0.0.1", agent.port)
    stub = ExternalScalerStub(channel)
    outcomes: list[str] = []

    async def hold(threshold: int) -> None:
        try:
            async for _ in stub.stream_is_active(ref(activationThreshold=str(threshold))):
                pass
            outcomes.append("OK")
        except GRPCError as error:
            outcomes.append(error.status.name)

    holders = [asyncio.create_task(hold(n)) for n in range(20)]
    await until(lambda: agent.frontend.scaler.open_streams == 20)
    await agent.stop()
    await asyncio.wait_for(asyncio.gather(*holders), timeout=5)
    channel.close()
    assert outcomes == ["OK"] * 20


async def test_health_follows_freshness(agent: Agent, channel: Channel) -> None:
    """Health is SERVING with fresh samples and NOT_SERVING once every GPU's reads hang."""
    health = HealthStub(channel)
    for service in ("", "externalscaler.ExternalScaler"):
        reply = await health.Check(HealthCheckRequest(service=service))
        assert reply.status == HealthCheckResponse.SERVING

    for index in range(4):
        fake(agent).fail(index, Failure.TIMEOUT)
    await until_result(
        lambda: health.Check(HealthCheckRequest()), lambda r: r.status == HealthCheckResponse.NOT_SERVING
    )
    fake(agent).heal(None)
    await until_result(lambda: health.Check(HealthCheckRequest()), lambda r: r.status == HealthCheckResponse.SERVING)


async def test_value_rounds_half_up_for_the_int_field(agent: Agent, channel: Channel) -> None:
    """metricValue is the float rounded half up (2.5 -> 3), never truncated."""
    fake(agent).set_values(0, {Metric.GPU_UTILIZATION: 2.5})
    await next_tick(agent)
    stub = ExternalScalerStub(channel)
    scaled = ref(gpuIndex="0")
    [value] = (
        await stub.get_metrics(
            GetMetricsRequest(scaled_object_ref=scaled, metric_name="gpuscaler-gpu_utilization-sum-gpu0")
        )
    ).metric_values
    assert (value.metric_value_float, value.metric_value) == (2.5, 3)
    assert math.isfinite(value.metric_value_float)


async def test_requests_over_the_limit_are_resource_exhausted(agent: Agent, channel: Channel) -> None:
    """A request message over 8 KiB is refused with RESOURCE_EXHAUSTED, and the agent keeps answering."""
    stub = ExternalScalerStub(channel)
    with pytest.raises(GRPCError) as raised:
        await stub.is_active(ref(targetValue="9" * (MAX_RECEIVE_MESSAGE_BYTES + 1)))
    assert raised.value.status is Status.RESOURCE_EXHAUSTED
    assert f"at most {MAX_RECEIVE_MESSAGE_BYTES} are accepted" in (raised.value.message or "")
    with pytest.raises(GRPCError) as under_limit:  # read and parsed: a number too big to be finite
        await stub.is_active(ref(targetValue="9" * (MAX_RECEIVE_MESSAGE_BYTES - 100)), timeout=10)
    assert under_limit.value.status is Status.INVALID_ARGUMENT
    assert (await stub.is_active(ref())).result is False
