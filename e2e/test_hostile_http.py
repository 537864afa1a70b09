"""Hostile clients of the metrics port, and an agent out of file descriptors: /healthz must stay answerable.

With TLS on the gRPC port, the chart's liveness probe is ``GET /healthz`` on the metrics port: a client that
can hold it down makes the kubelet restart a healthy agent. Two ways were found (issue 19, rows 8 and 9):
slow clients that trickle header bytes to fill the connection cap, and more idle connections than the
agent has file descriptors, which made the metrics listener spin on EMFILE and asyncio log a traceback per
failed accept. Loopback only; other loopback addresses (127.0.0.2 and up) stand for other peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import resource
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from e2e.conftest import StartAgent
from e2e.support.agent import AgentProcess
from e2e.support.raw_h2 import PREFACE
from tests.waiting import until

PROBE = "127.0.0.1"  # the kubelet's address: no slow client comes from it
TRICKLE_SECONDS = 0.5  # one header byte per slow connection this often: no idle timeout ever fires
HEADER_DEADLINE_SECONDS = 5.0  # bounded_http.HEADER_DEADLINE_SECONDS; the e2e tests see the process from outside
DEADLINE_SLACK_SECONDS = 2.0
PROBES = 5
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an HTTP/2 SETTINGS frame with no settings


def probe(port: int, path: str = "/healthz", *, source: str = PROBE, timeout: float = 3.0) -> int | str:
    """One request as the kubelet makes it: the status, or the name of the failure."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException) as error:
        return type(error).__name__
    finally:
        connection.close()


def series(agent: AgentProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample /metrics shows now, by name and sorted labels."""
    url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def cpu_seconds(pid: int) -> float:
    """User and system CPU the process (all its threads) has used, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    """How many descriptors the process has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class SlowClient:
    """A connection that sends a request line, then one byte of a header every tick, and never ends it."""

    source: str
    connected_at: float
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    answer: bytes = b""
    closed_after: float | None = None

    async def watch(self) -> None:
        """Read until the server ends the connection; when it did and what it said."""
        with contextlib.suppress(OSError):
            self.answer = await self.reader.read()
        self.closed_after = time.monotonic() - self.connected_at


class SlowClients:
    """Slow clients from ``sources`` (one connection each), all trickling on one clock."""

    def __init__(self, port: int, sources: Sequence[str]) -> None:
        self.port = port
        self.sources = sources
        self.clients: list[SlowClient] = []
        self.tick = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> SlowClients:
        for source in self.sources:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(source, 0))
            client = SlowClient(source, time.monotonic(), reader, writer)
            writer.write(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            self.clients.append(client)
            self._tasks.append(asyncio.create_task(client.watch()))
        self._tasks.append(asyncio.create_task(self._trickle()))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self.clients:
            client.writer.close()

    async def _trickle(self) -> None:
        while True:
            await asyncio.sleep(TRICKLE_SECONDS)  # the attack's own pace
            for client in self.clients:
                if client.closed_after is None and not client.writer.is_closing():
                    client.writer.write(b"a")
            async with self.tick:
                self.tick.notify_all()

    async def next_tick(self) -> None:
        """Return once every open slow connection has sent one more byte."""
        async with self.tick:
            await self.tick.wait()

    async def all_closed(self, timeout: float) -> None:
        """Return once the server has ended every slow connection; TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout):
            await asyncio.gather(*self._tasks[: len(self.clients)])


async def test_slow_header_clients_cannot_hold_healthz_down(start_agent: StartAgent) -> None:
    """32 slow connections (16 from one peer, 4 each from 4 more) leave /healthz answering 200 every time, and each
    one the agent kept is dropped at the header deadline although a byte arrives every 0.5 s."""
    agent = await start_agent(gpus=1)
    port = agent.metrics_port
    one_peer = ["127.0.0.2"] * 16
    four_peers = [f"127.0.0.{host}" for host in range(3, 7) for _ in range(4)]
    async with SlowClients(port, one_peer + four_peers) as slow:
        answers = []
        for _ in range(PROBES):
            await slow.next_tick()
            answers.append(await asyncio.to_thread(probe, port))
        assert answers == [200] * PROBES, answers
        await slow.all_closed(HEADER_DEADLINE_SECONDS + DEADLINE_SLACK_SECONDS)

    # Each was displaced by its own peer's next connection or kept until the deadline; a displaced one may be reset
    # before the client reads anything.
    assert all(client.closed_after is not None for client in slow.clients)
    displaced = [client for client in slow.clients if (client.closed_after or 0.0) < 1.0]
    kept = [client for client in slow.clients if (client.closed_after or 0.0) >= 1.0]
    assert len(kept) == 4 + len(four_peers)  # the per-peer cap: 4 of the one peer's 16
    assert len(displaced) == len(one_peer) - 4
    assert all(client.source == "127.0.0.2" for client in displaced)
    for client in kept:
        seconds = client.closed_after or 0.0
        assert HEADER_DEADLINE_SECONDS - 0.5 <= seconds <= HEADER_DEADLINE_SECONDS + DEADLINE_SLACK_SECONDS, seconds
        assert client.answer == b"" or client.answer.startswith(b"HTTP/1.0 408 "), client.answer
    assert any(client.answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n") for client in kept)

    counts = await asyncio.to_thread(series, agent)
    assert counts[("gpuscaler_http_limited_total", (("limit", "header_deadline"),))] >= len(kept)
    assert counts[("gpuscaler_http_limited_total", (("limit", "displaced"),))] >= len(displaced)
    lines = agent.events("http_limited")
    assert {line["limit"] for line in lines} == {"header_deadline", "displaced"}
    assert len(lines) <= 4, lines  # one line per limit and interval, not one per connection


@contextlib.asynccontextmanager
async def idle_grpc_connections(port: int, count: int) -> AsyncIterator[list[socket.socket]]:
    """``count`` HTTP/2 connections to the gRPC port that send the preface and then nothing, from 8 peers."""
    connections: list[socket.socket] = []
    try:
        for n in range(count):
            connection = await asyncio.to_thread(
                socket.create_connection, ("127.0.0.1", port), 5, (f"127.0.0.{2 + n % 8}", 0)
            )
            connection.sendall(PREFACE + EMPTY_SETTINGS)
            connections.append(connection)
        yield connections
    finally:
        for connection in connections:
            connection.close()


async def test_out_of_file_descriptors_backs_off_and_recovers(start_agent: StartAgent) -> None:
    """More idle gRPC connections than the agent has descriptors: no spin, a bounded log, /healthz back after."""
    agent = await start_agent(gpus=1)
    free = 24
    limit = open_fds(agent.pid) + free
    resource.prlimit(agent.pid, resource.RLIMIT_NOFILE, (limit, limit))  # what `prlimit --nofile` does
    async with idle_grpc_connections(agent.port, free + 16):
        await until(lambda: open_fds(agent.pid) >= limit, timeout=10)
        # A probe now waits in the metrics listener's queue: a listener that spins on EMFILE shows it here.
        waiting = socket.create_connection(("127.0.0.1", agent.metrics_port), timeout=15)
        waiting.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        answer = asyncio.create_task(asyncio.to_thread(_read_all, waiting))
        before = cpu_seconds(agent.pid)
        await asyncio.sleep(2.0)  # the window the CPU is measured over
        cpu = cpu_seconds(agent.pid) - before
        assert not answer.done()
    async with asyncio.timeout(10):
        reply = await answer
    assert reply.startswith(b"HTTP/1.0 200"), reply[:200]
    assert cpu < 0.5, f"the agent used {cpu:.2f} s of CPU in 2 s while out of descriptors"
    assert await asyncio.to_thread(probe, agent.metrics_port) == 200
    await asyncio.to_thread(agent.wait_health, "SERVING")

    # asyncio's own line for each failed accept, or ours for each listener and interval.
    accept_lines = [
        line for line in agent.log_text().splitlines() if "out of system resource" in line or "accept_failed" in line
    ]
    assert 2 <= len(accept_lines) <= 6, f"{len(accept_lines)} lines about accept:\n" + "\n".join(accept_lines[:10])
    failed = {str(event["listener"]) for event in agent.events("accept_failed")}
    assert failed == {"grpc", "metrics"}
    counts = await asyncio.to_thread(series, agent)
    for listener in ("grpc", "metrics"):
        assert counts[("gpuscaler_accept_errors_total", (("errno", "EMFILE"), ("listener", listener)))] >= 1


def _read_all(connection: socket.socket) -> bytes:
    with connection:
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)
