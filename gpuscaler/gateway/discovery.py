"""Where the agents are: a headless Service's DNS records, re-resolved; a file, re-read; or a static list.

The chart's headless Service publishes not-ready agents too, so that an unhealthy agent still counts
as a node the gateway knows of (``minNodes`` shares are taken of those), and only a deleted pod leaves.
A failed lookup keeps the last answer: a DNS hiccup is not a cluster with no nodes. An agent that is
no longer listed has left on purpose, and its node's share leaves every answer (see ``view.py``).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from gpuscaler.flags import Address, parse_address
from gpuscaler.model.errors import ConfigError

log = structlog.get_logger(__name__)

DEFAULT_RESOLVE_INTERVAL_SECONDS = 5.0
EndpointsListener = Callable[[frozenset[Address]], None]
# getaddrinfo's failures in words; its own strings ("Name or service not known") vary by libc.
_LOOKUP_FAILURES = {
    socket.EAI_NONAME: "name not known",
    socket.EAI_AGAIN: "no answer yet, a temporary failure",
    socket.EAI_FAIL: "the DNS server failed",
    **({socket.EAI_NODATA: "the name has no address"} if hasattr(socket, "EAI_NODATA") else {}),
}


def lookup_failure(name: str, error: socket.gaierror) -> str:
    """A failed DNS lookup of ``name`` in words, as a reason reads it: ``cannot resolve gpu-node-b: name not known
    (DNS)`` rather than ``gaierror(-2, 'Name or service not known')``. A stopped container's name leaves the
    compose network's DNS, so this is how an agent listed by name (``--agents node-b:6000``) reads while stopped."""
    known = _LOOKUP_FAILURES.get(error.errno) if error.errno is not None else None
    reason = known or (error.strerror or "lookup failed").lower()
    return f"cannot resolve {name}: {reason} (DNS)"


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
                reason = lookup_failure(self.name, error) if isinstance(error, socket.gaierror) else str(error)
                log.warning("agents_dns_failed", name=self.name, error=reason, keeping=len(self.endpoints or ()))
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


def read_agents_file(path: Path) -> frozenset[Address]:
    """The agents a file lists, one HOST:PORT per line; ConfigError names the line that is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read: {error.strerror}") from None
    agents = set()
    for number, line in enumerate(text.splitlines(), start=1):
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        where = f"line {number} {item!r}"
        address = parse_address(item, lambda allowed: ConfigError(f"{where}: {allowed}"))  # noqa: B023 - called at once
        if address.port == 0:
            raise ConfigError(f"line {number} {item!r}: every agent needs its port (not 0)")
        agents.add(address)
    return frozenset(agents)


class FileAgents:
    """The agents a file lists, re-read when its modification time changes (checked every ``interval_seconds``).

    A file that becomes unreadable or wrong keeps the last good list, as a failed DNS lookup does.
    """

    def __init__(self, path: Path, *, interval_seconds: float = DEFAULT_RESOLVE_INTERVAL_SECONDS) -> None:
        self.path = path
        self.interval_seconds = interval_seconds
        self.endpoints: frozenset[Address] | None = None
        self._stamp: tuple[int, int] | None = None

    async def run(self, listener: EndpointsListener) -> None:
        while True:
            self._check(listener)
            await asyncio.sleep(self.interval_seconds)

    def _check(self, listener: EndpointsListener) -> None:
        try:
            info = os.stat(self.path)
        except OSError as error:
            log.warning(
                "agents_file_failed", path=str(self.path), error=error.strerror, keeping=len(self.endpoints or ())
            )
            return
        stamp = (info.st_mtime_ns, info.st_size)
        if stamp == self._stamp:
            return
        try:
            found = read_agents_file(self.path)
        except ConfigError as error:
            log.error("agents_file_failed", path=str(self.path), error=str(error), keeping=len(self.endpoints or ()))
            return
        self._stamp = stamp
        if found != self.endpoints:
            before = self.endpoints or frozenset()
            log.info(
                "agents_listed",
                path=str(self.path),
                agents=len(found),
                added=sorted(map(str, found - before)),
                removed=sorted(map(str, before - found)),
            )
            self.endpoints = found
            listener(found)
