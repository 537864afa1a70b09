"""external-push: StreamIsActive sends the state at once, then only transitions, with hysteresis.

Every ``true`` KEDA receives requests a scale and postpones its cooldown, so a message while the state
holds is a bug, not noise.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from e2e.conftest import StartAgent
from e2e.support.clients import ActiveStream, ClientKind, ScalerClient, connect
from e2e.support.control import Control, fake_cli_async
from e2e.support.keda_grpcio import KedaProto

# Room for a busy 2-core machine on top of what the agent itself promises.
SLACK_SECONDS = 0.5


async def close_all(streams: list[ActiveStream]) -> None:
    """Close every stream at once."""
    await asyncio.gather(*(stream.close() for stream in streams))


@pytest.mark.parametrize("kind", ["grpclib", "grpcio"])
async def test_first_message_comes_at_once(start_agent: StartAgent, keda_proto: KedaProto, kind: ClientKind) -> None:
    """With a 5 s poll interval the first message still arrives at once, not after a tick."""
    agent = await start_agent(poll_interval=5.0)
    client = await connect(kind, agent, keda_proto)
    try:
        opened = time.monotonic()
        stream = client.stream_is_active({"gpuIndex": "0"})
        assert await stream.next(timeout=5) is False
        assert stream.received[0][0] - opened < 1.5
        await stream.close()
    finally:
        await client.close()


async def test_transition_within_one_poll_interval_of_fake_set(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """`gpuscaler fake set` across the threshold reaches a grpcio stream within one poll interval, both ways."""
    poll = 1.0
    agent = await start_agent(poll_interval=poll)
    client = await connect("grpcio", agent, keda_proto)
    try:
        stream = client.stream_is_active({"gpuIndex": "0", "activationThreshold": "50"})
        assert await stream.next() is False
        for value, expected in (("90", True), ("10", False)):
            code, output = await fake_cli_async(agent, "set", "--gpu", "0", f"gpu_utilization={value}")
            assert code == 0, output
            returned = time.monotonic()
            assert await stream.next(timeout=5) is expected
            assert stream.received[-1][0] - returned <= poll + SLACK_SECONDS
        await stream.close()
    finally:
        await client.close()


async def test_no_messages_while_the_state_holds(client: ScalerClient, control: Control) -> None:
    """Values that move but stay above the threshold send nothing for seconds; crossing back sends false."""
    stream = client.stream_is_active({"gpuIndex": "2", "activationThreshold": "50"})
    try:
        assert await stream.next() is False
        await control.set(2, {"gpu_utilization": 60})
        assert await stream.next() is True
        for value in (70, 95, 55, 80, 51):
            await control.set(2, {"gpu_utilization": value})
            await stream.no_message(0.7)  # three and a half ticks at 0.2 s
        await control.set(2, {"gpu_utilization": 10})
        assert await stream.next() is False
        assert [active for _, active in stream.received] == [False, True, False]
    finally:
        await stream.close()


async def test_hysteresis(client: ScalerClient, control: Control) -> None:
    """Active above activationThreshold, inactive again only at or below deactivationThreshold; IsActive agrees."""
    metadata = {"gpuIndex": "5", "activationThreshold": "50", "deactivationThreshold": "20"}
    stream = client.stream_is_active(metadata)
    try:
        assert await stream.next() is False
        state = False
        for value, message in ((30, None), (60, True), (30, None), (21, None), (20, False), (45, None), (51, True)):
            await control.set_and_wait(5, {"gpu_utilization": value})
            if message is None:
                await stream.no_message(0.6)
            else:
                assert await stream.next() is message, value
                state = message
            assert await client.is_active(metadata) is state, value
    finally:
        await stream.close()


async def test_many_streams_with_the_same_and_different_queries(client: ScalerClient, control: Control) -> None:
    """A change on one GPU reaches exactly the streams whose query it flips, once each, shared or not."""
    same = [client.stream_is_active({"gpuIndex": "3", "activationThreshold": "50"}) for _ in range(50)]
    renamed = [
        client.stream_is_active({"gpuIndex": "3", "activationThreshold": "50", "metricName": f"m{i}"})
        for i in range(10)
    ]
    per_gpu = [client.stream_is_active({"gpuIndex": str(i), "activationThreshold": "50"}) for i in range(8)]
    thresholds = [30, 40, 50, 60, 70]
    by_threshold = [client.stream_is_active({"aggregation": "max", "activationThreshold": str(t)}) for t in thresholds]
    everything = same + renamed + per_gpu + by_threshold
    try:
        assert await asyncio.gather(*(stream.next() for stream in everything)) == [False] * len(everything)

        await control.set(3, {"gpu_utilization": 65})
        flipped = same + renamed + [per_gpu[3]] + by_threshold[:4]
        assert await asyncio.gather(*(stream.next() for stream in flipped)) == [True] * len(flipped)
        quiet = [s for s in everything if s not in flipped]
        await asyncio.gather(*(stream.no_message(1.0) for stream in everything))
        assert all(len(stream.received) == 1 for stream in quiet)
        assert all(len(stream.received) == 2 for stream in flipped)
    finally:
        await close_all(everything)
