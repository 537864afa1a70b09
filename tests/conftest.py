"""Fixtures shared by the in-process tests: a real agent on loopback with fake GPUs, and clients for it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from grpclib.client import Channel

from gpuscaler import logs
from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.agent.settings import ServeSettings, settings_from_args
from gpuscaler.cli import build_parser

StartAgent = Callable[..., Coroutine[Any, Any, Agent]]


def pytest_configure(config: pytest.Config) -> None:
    """In-process agents log to stderr as the real process does, so stdout stays the CLI's."""
    logs.configure(log_format="console", level="debug")


def serve_settings(*flags: str) -> ServeSettings:
    """Settings as `gpuscaler serve --collector fake` on ephemeral loopback ports, plus FLAGS, would build them."""
    environ: dict[str, str] = {}
    args = build_parser(environ).parse_args(
        [
            *("serve", "--collector", "fake", "--log-format", "json"),
            *("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"),
            *flags,
        ]
    )
    return settings_from_args(args, environ)


@pytest.fixture
async def start_agent() -> AsyncIterator[StartAgent]:
    """Starts in-process agents on ephemeral loopback ports and stops every one at the end."""
    agents: list[Agent] = []

    async def start(*flags: str, gpus: int = 4) -> Agent:
        settings = serve_settings("--fake-gpus", str(gpus), *flags)
        collector = FakeCollector(node="test-node", gpu_count=gpus)
        agent = await Agent.start(settings, collector)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        await agent.stop()


@pytest.fixture
async def agent(start_agent: StartAgent) -> Agent:
    """One agent with 4 fake GPUs polling every 0.1 s."""
    return await start_agent("--poll-interval", "0.1")


@pytest.fixture
async def channel(agent: Agent) -> AsyncIterator[Channel]:
    """A grpclib channel to ``agent``."""
    channel = Channel("127.0.0.1", agent.port)
    yield channel
    channel.close()
