"""The /metrics listener over raw HTTP/1.1: routes, keep-alive, and the bounds on what a client may send."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Counter

import gpuscaler.exposition as exposition
from gpuscaler.errors import StartupError
from gpuscaler.exposition import MetricsServer
from gpuscaler.flags import Address


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    """A metrics listener on an ephemeral loopback port with one counter, healthy until told otherwise."""
    registry = CollectorRegistry()
    Counter("demo_total", "A demo counter.", registry=registry).inc()
    listener = MetricsServer(registry, Address("127.0.0.1", 0), healthy=lambda: True)
    await listener.start()
    yield listener
    await listener.stop()


async def exchange(port: int, request: bytes) -> tuple[bytes, bool]:
    """Send ``request`` on a fresh connection; what came back, and whether the server then closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = b""
        try:
            async with asyncio.timeout(0.5):
                while chunk := await reader.read(65_536):
                    answer += chunk
            return answer, True
        except TimeoutError:
            return answer, False
    finally:
        writer.close()


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_the_three_routes_answer_and_others_do_not(server: MetricsServer) -> None:
    """/metrics, /healthz and / answer 200; another path is 404 and another method 405."""
    for path, expected in (("/metrics", b"demo_total 1.0"), ("/healthz", b"SERVING"), ("/", b"/metrics")):
        answer, _ = await exchange(server.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status(answer) == 200
        assert expected in answer
    answer, _ = await exchange(server.port, b"GET /metrics?name=demo HTTP/1.1\r\n\r\n")
    assert b"demo_total 1.0" in answer
    assert status((await exchange(server.port, b"GET /other HTTP/1.1\r\n\r\n"))[0]) == 404
    assert status((await exchange(server.port, b"DELETE /metrics HTTP/1.1\r\n\r\n"))[0]) == 405


async def test_head_gets_the_headers_without_the_body(server: MetricsServer) -> None:
    """HEAD /metrics answers the Content-Length a GET would have, and no body."""
    answer, _ = await exchange(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status(answer) == 200
    assert b"Content-Length: " in head
    assert body == b""


async def test_one_connection_serves_many_requests(server: MetricsServer) -> None:
    """HTTP/1.1 keeps the connection for the next request, as Prometheus scrapes; Connection: close ends it."""
    request = b"GET /healthz HTTP/1.1\r\n\r\n"
    answer, closed = await exchange(server.port, request * 3)
    assert answer.count(b"HTTP/1.1 200 OK") == 3
    assert not closed
    answer, closed = await exchange(server.port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert status(answer) == 200
    assert closed
    _, closed = await exchange(server.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert closed


async def test_oversized_or_malformed_requests_are_refused_and_closed(server: MetricsServer) -> None:
    """A body over 1 KiB is 413, a head over 8 KiB is 431, a broken request line is 400; each then closes."""
    body = b"x" * (exposition.MAX_BODY_BYTES + 1)
    answer, closed = await exchange(
        server.port, b"POST /metrics HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert (status(answer), closed) == (413, True)
    big_header = b"X-Big: " + b"a" * exposition.MAX_HEAD_BYTES + b"\r\n"
    answer, closed = await exchange(server.port, b"GET /metrics HTTP/1.1\r\n" + big_header + b"\r\n")
    assert (status(answer), closed) == (431, True)
    for broken in (b"GARBAGE\r\n\r\n", b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n", b"GET / SPDY/3\r\n\r\n"):
        answer, closed = await exchange(server.port, broken)
        assert status(answer) in (400, 505)
        assert closed


async def test_an_idle_connection_is_closed(server: MetricsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that sends nothing for the keep-alive timeout is closed by the server."""
    monkeypatch.setattr(exposition, "KEEPALIVE_TIMEOUT_SECONDS", 0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    writer.close()


async def test_stop_closes_open_connections(server: MetricsServer) -> None:
    """stop() returns promptly with a client still connected, and that client sees the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
    await reader.readuntil(b"SERVING\n")
    async with asyncio.timeout(exposition.SHUTDOWN_TIMEOUT_SECONDS + 1):
        await server.stop()
        assert await reader.read() == b""
    writer.close()


async def test_a_port_in_use_is_a_startup_error(server: MetricsServer) -> None:
    """Binding a port another listener holds fails with a message naming the flag."""
    second = MetricsServer(CollectorRegistry(), Address("127.0.0.1", server.port))
    with pytest.raises(StartupError, match=r"--metrics-listen 127.0.0.1:\d+: cannot listen"):
        await second.start()
