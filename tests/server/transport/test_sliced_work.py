"""Work for many streams at once, done a slice a turn of the event loop; a closing connection's calls among it."""

from __future__ import annotations

import asyncio
import gc
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings

from gpuscaler.agent.process import Agent
from gpuscaler.server.transport import sliced_work
from gpuscaler.server.transport.sliced_work import SlicedQueue, sliced_queue
from tests.conftest import StartAgent
from tests.waiting import until

STREAM_IS_ACTIVE = "/externalscaler.ExternalScaler/StreamIsActive"
EMPTY_REF = struct.pack(">?I", False, 0)  # a ScaledObjectRef with nothing set, as a gRPC message


async def test_a_queue_does_at_most_its_slice_a_turn_oldest_first() -> None:
    """Ten items with a slice of three take four turns of the loop, in the order they came."""
    queue = SlicedQueue(asyncio.get_running_loop(), per_slice=3)
    done: list[int] = []
    for item in range(10):
        queue.add(lambda item=item: done.append(item))  # type: ignore[misc]
    assert done == []  # nothing runs in the turn that added it
    seen = []
    while len(done) < 10:
        await asyncio.sleep(0)  # one turn
        seen.append(len(done))
    assert seen == [3, 6, 9, 10]
    assert done == list(range(10))
    assert len(queue) == 0


async def test_each_event_loop_has_its_own_queue() -> None:
    """The running loop's queue is the same one every time, and another loop's is not it."""
    mine = sliced_queue()
    assert sliced_queue() is mine

    async def other() -> SlicedQueue:
        return sliced_queue()

    assert await asyncio.to_thread(asyncio.run, other()) is not mine


def _request_headers(path: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "test"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


async def test_a_closing_connection_cancels_its_streams_in_slices_and_leaves_no_cycles(
    start_agent: StartAgent,
) -> None:
    """A connection that goes with hundreds of push streams open ends them all, a slice a turn, and what they held
    is freed at once: nothing but h2's own stream objects is left for the cycle collector."""
    agent: Agent = await start_agent("--poll-interval", "0.1")
    server = agent.frontend.server
    count = 3 * sliced_work.PER_SLICE
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.port)
    writer.write(client.data_to_send())
    answered: set[int] = set()
    async with asyncio.timeout(20):
        settings = False  # the server's SETTINGS, acknowledged: h2 holds us to its raised stream limit only after
        while not settings:
            events = client.receive_data(await reader.read(65_536))
            settings = any(isinstance(event, h2.events.RemoteSettingsChanged) for event in events)
            writer.write(client.data_to_send())
        for index in range(count):
            client.send_headers(1 + 2 * index, _request_headers(STREAM_IS_ACTIVE))
            client.send_data(1 + 2 * index, EMPTY_REF, end_stream=True)
        writer.write(client.data_to_send())
        while len(answered) < count:
            data = await reader.read(65_536)
            assert data, "the agent closed the connection"
            for event in client.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    answered.add(event.stream_id)  # the stream's first message
            writer.write(client.data_to_send())
    gc.collect()
    gc.disable()  # what the close leaves in cycles is counted below, not collected on the way
    try:
        writer.close()
        await until(lambda: server.handler_tasks == 0)
        left_in_cycles = gc.collect()
    finally:
        gc.enable()
    # grpclib's close left each stream's frames, tasks and messages in cycles, 73 objects a stream; h2's stream
    # and its state machine (3 objects) are what is left.
    assert left_in_cycles < 10 * count, f"{left_in_cycles} objects in cycles after {count} streams closed"
