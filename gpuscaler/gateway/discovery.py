"""Where the agents are: a static list (compose, tests), or a headless Service's DNS records, re-resolved.

The chart's headless Service publishes not-ready agents too, so that an unhealthy agent still counts
as a node the gateway knows of (``minNodes`` shares are taken of those), and only a deleted pod leaves.
A failed lookup keeps the last answer: a DNS hiccup is not a cluster with no nodes.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence

import structlog

from gpuscaler.settings import Address

log = structlog.get_logger(__name__)

DEFAULT_RESOLVE_INTERVAL_SECONDS = 5.0
EndpointsListener = Callable[[frozenset[Address]], None]


class StaticAgents:
    """A fixed list of agents."""

    def __init__(self, endpoints: Sequence[Address]) -> None:
        self.endpoints = frozenset(endpoints)

    async def run(self, listener: EndpointsListener) -> None:
        listener(self.endpoints)
        await asyncio.Event().wait()  # nothing changes; wait to be cancelled


class DnsAgents:
    """Every address ``name`` resolves to, on ``port``, looked up every ``interval_seconds``."""

    def __init__(self, name: str, port: int, *, interval_seconds: float = DEFAULT_RESOLVE_INTERVAL_SECONDS) -> None:
        self.name = name
        self.port = port
        self.interval_seconds = interval_seconds
        self.endpoints: frozenset[Address] | None = None

    async def resolve(self) -> frozenset[Address]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        return frozenset(Address(str(info[4][0]), self.port) for info in infos)

    async def run(self, listener: EndpointsListener) -> None:
        while True:
            try:
                found = await self.resolve()
            except OSError as error:
                log.warning("agents_dns_failed", name=self.name, error=str(error), keeping=len(self.endpoints or ()))
            else:
                if found != self.endpoints:
                    before = self.endpoints or frozenset()
                    log.info(
                        "agents_resolved",
                        name=self.name,
                        agents=len(found),
                        added=sorted(map(str, found - before)),
                        removed=sorted(map(str, before - found)),
                    )
                    self.endpoints = found
                    listener(found)
            await asyncio.sleep(self.interval_seconds)
