"""The agent's start: nothing is served before the first sample is in the history."""

from __future__ import annotations

import asyncio
import socket

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.process import Agent
from tests.conftest import serve_settings


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def connects(port: int) -> bool:
    """Whether a TCP connection to loopback ``port`` is accepted (it is closed again at once)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def test_the_port_opens_only_after_the_first_sample() -> None:
    """While the first poll is still reading, the gRPC port refuses connections; it opens once the sample is in."""
    port = free_port()
    # A hung first read holds the first tick for most of the 10 s interval, long enough to look at the port.
    collector = FakeCollector(node="test-node", gpu_count=1)
    collector.fail(0, Failure.TIMEOUT)
    settings = serve_settings("--fake-gpus", "1", "--poll-interval", "10", "--listen", f"127.0.0.1:{port}")
    starting = asyncio.create_task(Agent.start(settings, collector))
    try:
        async with asyncio.timeout(5):
            while not collector.reads_started:
                await asyncio.sleep(0.01)
        assert not await connects(port)
        assert not starting.done()
    finally:
        collector.heal(None)
    agent = await starting
    try:
        assert agent.evaluator.source.latest is not None
        assert await connects(port)
    finally:
        await agent.stop()
