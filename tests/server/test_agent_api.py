"""The agent's own API (gpuscaler.v1.Agent): the snapshot the gateway builds on, and Explain for `query`."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.generated.externalscaler import ExternalScalerStub, ScaledObjectRef
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.windows import MAX_WINDOWS, READ_WINDOWS_RESERVE, WindowKey
from gpuscaler.server.agent_api import AgentService
from tests.builders import decoded
from tests.server.test_external_scaler import next_tick


def fake(agent: Agent) -> FakeCollector:
    """The agent's FakeCollector, to set values and failures on."""
    assert isinstance(agent.collector, FakeCollector)
    return agent.collector


async def test_snapshot_carries_every_gpu_in_units(agent: Agent, channel: Channel) -> None:
    """GetSnapshot returns the newest snapshot: node, sequence, and each GPU's values in their units."""
    fake(agent).set_values(2, {Metric.GPU_UTILIZATION: 42.0, Metric.MEMORY_USED_PERCENT: 50.0})
    fake(agent).fail(3, Failure.NOT_SUPPORTED)
    await next_tick(agent)
    message = await pb.AgentStub(channel).get_snapshot(pb.GetSnapshotRequest())

    assert message.node == "test-node"
    assert message.poll_interval_seconds == 0.1
    assert [gpu.uuid for gpu in message.gpus] == [f"GPU-fake-test-node-{i}" for i in range(4)]
    assert {error.kind for error in message.gpus[3].errors} == {pb.ReadErrorKind.NOT_SUPPORTED}
    samples = decoded(message).samples
    assert samples[2].gpu_utilization_percent == 42.0
    assert samples[2].memory_used_bytes == 40 * 1024**3
    assert samples[2].memory_total_bytes == 80 * 1024**3
    assert samples[2].value(Metric.MEMORY_USED_PERCENT) == 50.0
    assert samples[3].gpu_utilization_percent is None  # absent on the wire (NaN), not 0


async def test_watch_sends_one_snapshot_per_tick(agent: Agent, channel: Channel) -> None:
    """WatchSnapshots sends the newest snapshot at once, then each new one, with consecutive sequences."""
    sequences: list[int] = []
    async with asyncio.timeout(5):
        async for message in pb.AgentStub(channel).watch_snapshots(pb.WatchSnapshotsRequest()):
            sequences.append(message.sequence)
            if len(sequences) == 4:
                break
    assert sequences == list(range(sequences[0], sequences[0] + 4))


async def first_snapshot(channel: Channel, request: pb.WatchSnapshotsRequest) -> pb.Snapshot:
    """The first message of a WatchSnapshots stream for ``request``, within 5 s."""
    async with asyncio.timeout(5):
        async for message in pb.AgentStub(channel).watch_snapshots(request):
            return message
    raise AssertionError("the stream ended without a snapshot")


async def test_watch_sends_the_windows_asked_for_reduced_over_the_ring_buffer(agent: Agent, channel: Channel) -> None:
    """Each snapshot carries every asked-for window, per GPU in order, equal to the agent's own reduction."""
    fake(agent).set_values(0, {Metric.GPU_UTILIZATION: 40.0})
    fake(agent).fail(1, Failure.LOST)
    await next_tick(agent)
    windows = [
        pb.WindowSpec(metric="gpu_utilization", seconds=1.0, function="max"),
        pb.WindowSpec(metric="power_draw", seconds=3600.0, function="avg"),  # beyond its 10 min of history
        pb.WindowSpec(metric="gpu_utilization", seconds=0.01, function="last"),  # the newest sample alone
    ]
    message = await first_snapshot(channel, pb.WatchSnapshotsRequest(windows=windows))
    utilization, power, newest = message.windows
    assert utilization.window == windows[0]
    assert utilization.problem == ""
    assert len(utilization.packed_values) == len(utilization.packed_samples) == len(message.gpus) == 4
    assert utilization.packed_values[0] == 40.0
    assert utilization.packed_samples[0] >= 1
    assert math.isnan(newest.packed_values[1])  # the lost GPU: absent, not 0
    assert newest.packed_samples[1] == 0
    assert newest.packed_values[0] == 40.0
    assert utilization.details == []  # no reason or pod share to tell
    assert "longer than this agent's --history of 10m" in power.problem
    assert list(power.packed_values) == []


async def test_watch_refuses_a_window_it_cannot_name(agent: Agent, channel: Channel) -> None:
    """A window with an unknown metric, function or length is INVALID_ARGUMENT naming the field."""
    for spec, complaint in (
        (pb.WindowSpec(metric="flops", seconds=1.0, function="max"), "window metric 'flops'"),
        (pb.WindowSpec(metric="temperature", seconds=1.0, function="mode"), "window function 'mode'"),
        (pb.WindowSpec(metric="temperature", seconds=0.0, function="max"), "window seconds 0.0"),
    ):
        with pytest.raises(GRPCError) as raised:
            await first_snapshot(channel, pb.WatchSnapshotsRequest(windows=[spec]))
        assert raised.value.status is Status.INVALID_ARGUMENT
        assert complaint in (raised.value.message or "")


async def test_watch_serves_keda_s_windows_and_a_gateway_s_read_reserve(agent: Agent, channel: Channel) -> None:
    """A stream asking for MAX_WINDOWS + READ_WINDOWS_RESERVE windows (a gateway's most) is served; one more is
    INVALID_ARGUMENT naming the limit."""
    served = MAX_WINDOWS + READ_WINDOWS_RESERVE
    specs = [pb.WindowSpec(metric="gpu_utilization", seconds=float(s), function="max") for s in range(1, served + 2)]
    await next_tick(agent)
    message = await first_snapshot(channel, pb.WatchSnapshotsRequest(windows=specs[:served]))
    assert len(message.windows) == served
    with pytest.raises(GRPCError) as raised:
        await first_snapshot(channel, pb.WatchSnapshotsRequest(windows=specs))
    assert raised.value.status is Status.INVALID_ARGUMENT
    assert f"at most {served} are served" in (raised.value.message or "")


async def test_explain_shows_each_gpu_and_the_result(agent: Agent, channel: Channel) -> None:
    """Explain gives the resolved query, each GPU's windowed value or reason (one left out within maxUnreadable),
    and the value and state."""
    fake(agent).set_values(None, {Metric.POWER_DRAW: 200.0})
    fake(agent).fail(1, Failure.LOST)
    await next_tick(agent)
    metadata = {
        "metric": "power_draw",
        "window": "1s",
        "windowFunction": "max",
        "activationThreshold": "100",
        "maxUnreadable": "1",
    }
    request = pb.ExplainRequest(scaler_metadata=metadata)
    explanation = await pb.AgentStub(channel).explain(request)

    assert (explanation.metric, explanation.aggregation, explanation.window_function) == ("power_draw", "sum", "max")
    assert explanation.window_seconds == 1.0
    assert explanation.value == 600.0
    assert explanation.active is True
    assert explanation.error_code == ""
    assert [gpu.included for gpu in explanation.gpus] == [True, False, True, True]
    assert "gpu_lost" in explanation.gpus[1].reason
    assert explanation.gpus[0].samples >= 1
    assert explanation.nodes == 1


async def test_explain_reads_the_activation_state_without_moving_it(agent: Agent, channel: Channel) -> None:
    """Explain says what IsActive would answer now, and leaves the hysteresis state as KEDA's calls left it: a value
    between the thresholds after it still reads inactive, as if Explain had not been asked."""
    metadata = {"aggregation": "max", "activationThreshold": "50", "deactivationThreshold": "20"}
    ref = ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)

    async def utilization(value: float) -> None:
        fake(agent).set_values(None, {Metric.GPU_UTILIZATION: value})
        await next_tick(agent)

    await utilization(30.0)
    assert (await ExternalScalerStub(channel).is_active(ref)).result is False  # 30 is not above 50
    await utilization(60.0)
    explanation = await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata=metadata))
    assert explanation.active is True  # what IsActive would answer for 60
    await utilization(30.0)
    assert (await ExternalScalerStub(channel).is_active(ref)).result is False  # had Explain moved it: 30 > 20, active


async def test_explain_waits_for_windows_within_the_call_s_deadline(
    agent: Agent, channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Explain gives the wait for its windows (at a gateway, for a window the agents have not sent) what is left of
    the call's deadline, not the fixed few seconds a call with none gets."""
    waits: list[float | None] = []
    source = agent.evaluator.source
    read_windows = source.windows_for_read

    def recording(windows: Sequence[WindowKey], *, time_left: float | None = None) -> AbstractAsyncContextManager[None]:
        waits.append(time_left)
        return read_windows(windows, time_left=time_left)

    monkeypatch.setattr(source, "windows_for_read", recording)
    await next_tick(agent)
    await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata={"window": "30s"}), timeout=0.5)
    assert len(waits) == 1
    assert waits[0] is not None
    assert 0 < waits[0] <= 0.5


async def test_explain_reports_the_error_keda_would_get(agent: Agent, channel: Channel) -> None:
    """When the query cannot answer, Explain carries the gRPC code and message instead of a value."""
    fake(agent).fail(0, Failure.NOT_SUPPORTED)
    await next_tick(agent)
    explanation = await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata={"gpuIndex": "0"}))
    assert explanation.value is None
    assert explanation.error_code == "FAILED_PRECONDITION"
    assert "GPU 0" in explanation.error_message


async def test_every_getsnapshot_of_one_tick_gets_one_message_encoded_once(agent: Agent, channel: Channel) -> None:
    """A flood of GetSnapshot costs one message and one encoding per tick, not one per call."""
    service = AgentService(agent.evaluator)
    await next_tick(agent)
    first = await service.get_snapshot(pb.GetSnapshotRequest())
    assert await service.get_snapshot(pb.GetSnapshotRequest()) is first  # no tick between: nothing awaited
    codec = agent.frontend.server._codec
    assert codec.encode(first, pb.Snapshot) is codec.encode(first, pb.Snapshot)
    await next_tick(agent)
    later = await service.get_snapshot(pb.GetSnapshotRequest())
    assert later is not first
    assert later.sequence > first.sequence
    # Over the wire, the answers are what the message encodes to.
    answered = await pb.AgentStub(channel).get_snapshot(pb.GetSnapshotRequest())
    assert answered.node == first.node
