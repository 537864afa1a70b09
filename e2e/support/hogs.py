"""Strangers that hold connections without using them, from many loopback addresses, reopening as they are closed.

``Hogs`` hold gRPC connections that send nothing, part of a preface, or a preface only (on a TLS port, nothing is
no ClientHello); ``SlowLoris`` holds metrics-port connections that trickle header bytes. Both reopen a connection
the server closed, as an attacker keeping a pool full would: one held a while at once, one turned away at once
after RETRY_SECONDS. Addresses 127.1.0.1 and up stand for other hosts (the kubelet's and the good caller's is
127.0.0.1). ``python -m e2e.support.hogs hold|slowloris --port P ...`` runs one for bench/attacks.py and prints
one JSON line; every loop is bounded in opens and in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from e2e.support.attacks import settings_frame
from e2e.support.raw_h2 import PREFACE

RETRY_SECONDS = 0.1  # a connection closed at once tries again after this
HELD_SECONDS = 1.0  # a connection closed later than this was held, and is reopened at once
TRICKLE_SECONDS = 0.5  # SlowLoris: one header byte this often, inside every idle timeout
FIRST_BYTES = {"nothing": b"", "partial": PREFACE[:10], "preface": PREFACE + settings_frame()}


def sources(count: int) -> tuple[str, ...]:
    """``count`` loopback addresses other than 127.0.0.1."""
    return tuple(f"127.1.{index // 250}.{index % 250 + 1}" for index in range(count))


@dataclass
class _Holders:
    """``count`` tasks from ``addresses`` in turn, each holding one connection at a time; the shared counts."""

    port: int
    count: int
    addresses: Sequence[str]
    max_opens: int = 100_000
    opens: int = 0
    turned_away: int = 0  # closed by the server within HELD_SECONDS
    open_now: int = 0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _use(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _hold(self, source: str) -> None:
        while self.opens < self.max_opens:
            self.opens += 1
            opened = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
            except OSError:
                self.turned_away += 1
                await asyncio.sleep(RETRY_SECONDS)
                continue
            self.open_now += 1
            try:
                with contextlib.suppress(OSError):
                    await self._use(reader, writer)
            finally:
                self.open_now -= 1
                writer.close()
            if time.monotonic() - opened < HELD_SECONDS:
                self.turned_away += 1
                await asyncio.sleep(RETRY_SECONDS)

    async def __aenter__(self) -> Any:
        for index in range(self.count):
            self._tasks.append(asyncio.create_task(self._hold(self.addresses[index % len(self.addresses)])))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def summary(self) -> dict[str, Any]:
        return {"opens": self.opens, "turned_away": self.turned_away, "open_now": self.open_now}


@dataclass
class Hogs(_Holders):
    """gRPC connections that send ``first_bytes`` and then nothing, reading what the server sends until it closes."""

    first_bytes: bytes = b""

    async def _use(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.first_bytes:
            writer.write(self.first_bytes)
        while await reader.read(65_536):  # the server's SETTINGS (and GOAWAY), until it closes
            pass


@dataclass
class SlowLoris(_Holders):
    """Metrics-port connections that send a request line and then one header byte every TRICKLE_SECONDS."""

    async def _use(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
        while not reader.at_eof():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TRICKLE_SECONDS):
                    await reader.read(65_536)
            writer.write(b"a")


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    addresses = sources(args.sources)
    holders: _Holders
    if args.attack == "hold":
        holders = Hogs(args.port, args.count, addresses, first_bytes=FIRST_BYTES[args.first])
    else:
        holders = SlowLoris(args.port, args.count, addresses)
    async with holders:
        await asyncio.sleep(args.seconds)  # the attack's length: the holders run meanwhile
        return {"sources": len(addresses), "count": args.count, **holders.summary()}


def main(argv: list[str] | None = None) -> int:
    """Run one attack against ``--port`` for ``--seconds`` and print what it saw as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m e2e.support.hogs", description=__doc__.splitlines()[0])
    parser.add_argument("attack", choices=["hold", "slowloris"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=256, help="connections held at once")
    parser.add_argument("--sources", type=int, default=64, help="loopback addresses they come from")
    parser.add_argument("--first", choices=sorted(FIRST_BYTES), default="nothing", help="hold: what each sends")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the attack runs")
    args = parser.parse_args(argv)
    result = asyncio.run(_run(args))
    print(json.dumps({"attack": args.attack, "first": args.first, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
