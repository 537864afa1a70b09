"""StreamMetricSpec (KEDA 2.21, ``external-push`` triggers only): GetMetricSpec's answer at once, then held open
without work until the client goes or the server closes, and counted against --max-streams as a push stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import h2.errors
import h2.events
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from gpuscaler.generated.externalscaler import ExternalScalerStub
from tests.conftest import StartAgent
from tests.server.test_external_scaler import ref
from tests.server.transport.test_limits import STREAM_IS_ACTIVE, _guard, _Peer
from tests.waiting import until

STREAM_METRIC_SPEC = "/externalscaler.ExternalScaler/StreamMetricSpec"
IS_ACTIVE = "/externalscaler.ExternalScaler/IsActive"


async def test_the_spec_arrives_at_once_equal_to_get_metric_spec_and_the_stream_stays_open(
    start_agent: StartAgent,
) -> None:
    """The first message is GetMetricSpec's answer; the stream then holds one push place, and its client going
    frees it."""
    agent = await start_agent("--poll-interval", "0.1")
    channel = Channel("127.0.0.1", agent.port)
    try:
        stub = ExternalScalerStub(channel)
        scaled = ref(metric="gpu_utilization", targetValue="60.4")
        expected = await stub.get_metric_spec(scaled)
        stream = stub.stream_metric_spec(scaled)
        assert isinstance(stream, AsyncGenerator)  # closed below, as a client going away
        first = await asyncio.wait_for(anext(stream), timeout=10)
        assert first == expected
        assert first.metric_specs[0].metric_name == "gpuscaler-gpu_utilization-sum"
        await until(lambda: agent.frontend.scaler.open_spec_streams == 1)
        assert _guard(agent).push_streams == 1
        assert agent.frontend.scaler.open_streams == 0  # no StreamIsActive subscription: nothing is evaluated
        await stream.aclose()  # the client goes
        await until(lambda: agent.frontend.scaler.open_spec_streams == 0 and _guard(agent).push_streams == 0)
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("metadata", "names"),
    [
        ({"activationTreshold": "5"}, ["activationTreshold", "activationThreshold"]),
        ({"targetValue": "NaN"}, ["targetValue", "NaN"]),
    ],
    ids=["typo", "nan-target"],
)
async def test_bad_metadata_is_refused_as_get_metric_spec_refuses_it(
    start_agent: StartAgent, metadata: dict[str, str], names: list[str]
) -> None:
    """Bad metadata is INVALID_ARGUMENT naming the key and value, with GetMetricSpec's message, and holds nothing."""
    agent = await start_agent()
    channel = Channel("127.0.0.1", agent.port)
    try:
        stub = ExternalScalerStub(channel)
        with pytest.raises(GRPCError) as unary:
            await stub.get_metric_spec(ref(**metadata))
        with pytest.raises(GRPCError) as streamed:
            await asyncio.wait_for(anext(stub.stream_metric_spec(ref(**metadata))), timeout=10)
    finally:
        channel.close()
    assert streamed.value.status is Status.INVALID_ARGUMENT
    assert streamed.value.message == unary.value.message
    for name in names:
        assert name in (streamed.value.message or "")
    await until(lambda: _guard(agent).streams == 0)
    assert agent.frontend.scaler.open_spec_streams == 0


async def test_a_spec_stream_counts_against_max_streams_and_a_client_that_goes_frees_its_place(
    start_agent: StartAgent,
) -> None:
    """With --max-streams 2, a StreamIsActive and a StreamMetricSpec fill it: the next spec stream is refused
    REFUSED_STREAM as a push stream is, a unary call still gets in, and a reset spec stream frees its place."""
    agent = await start_agent("--max-streams", "2")
    peer = await _Peer.connect(agent.port)
    try:
        peer.call(1, STREAM_IS_ACTIVE)
        peer.call(3, STREAM_METRIC_SPEC)
        await until(lambda: _guard(agent).push_streams == 2 and agent.frontend.scaler.open_spec_streams == 1)
        peer.call(5, STREAM_METRIC_SPEC)
        await peer.read_until(lambda: 5 in peer.resets())
        assert peer.resets() == {5: h2.errors.ErrorCodes.REFUSED_STREAM}
        assert _guard(agent).limited["max_streams"] == 1
        peer.call(7, IS_ACTIVE)  # the unary reserve beside the full push streams
        await peer.read_until(lambda: _ended(peer, 7))
        assert 7 not in peer.resets()
        peer.h2.reset_stream(3)  # the spec stream's client goes
        peer.send()
        await until(lambda: _guard(agent).push_streams == 1 and agent.frontend.scaler.open_spec_streams == 0)
        peer.call(9, STREAM_METRIC_SPEC)  # its place is free again
        await until(lambda: _guard(agent).push_streams == 2 and agent.frontend.scaler.open_spec_streams == 1)
        assert _guard(agent).limited["max_streams"] == 1
    finally:
        peer.close()


async def test_stopping_the_server_ends_every_spec_stream_ok(start_agent: StartAgent) -> None:
    """Stopping the agent ends each open StreamMetricSpec with status OK after its one message, as the push
    streams end, so KEDA retries on another replica."""
    agent = await start_agent("--poll-interval", "0.1")
    channel = Channel("127.0.0.1", agent.port)
    stub = ExternalScalerStub(channel)
    outcomes: list[tuple[int, str]] = []

    async def hold(target: int) -> None:
        received = 0
        try:
            async for _ in stub.stream_metric_spec(ref(targetValue=str(target))):
                received += 1
            outcomes.append((received, "OK"))
        except GRPCError as error:
            outcomes.append((received, error.status.name))

    holders = [asyncio.create_task(hold(n)) for n in range(1, 21)]
    try:
        await until(lambda: agent.frontend.scaler.open_spec_streams == 20)
        await agent.stop()
        await asyncio.wait_for(asyncio.gather(*holders), timeout=5)
    finally:
        channel.close()
    assert outcomes == [(1, "OK")] * 20


def _ended(peer: _Peer, stream_id: int) -> bool:
    return any(isinstance(e, h2.events.StreamEnded) and e.stream_id == stream_id for e in peer.events)
