"""The /metrics and /healthz HTTP server, driven over real sockets by the standard library's HTTP client."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpuscaler import exposition
from gpuscaler.errors import StartupError
from gpuscaler.exposition import MetricsServer
from gpuscaler.flags import Address
from tests.waiting import until

Response = tuple[int, str, bytes]


def get(port: int, path: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> Response:
    """Status, Content-Type and body of one request (blocking: run it on a thread)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


async def fetch(port: int, path: str, **options: object) -> Response:
    """``get`` on a thread, so the loop stays free to answer it."""
    return await asyncio.to_thread(get, port, path, **options)  # type: ignore[arg-type]


class Healthy:
    """A health flag the test turns."""

    def __init__(self) -> None:
        self.serving = True

    def __call__(self) -> bool:
        return self.serving


@pytest.fixture
def registry() -> CollectorRegistry:
    """A registry with one gauge at 42."""
    registry = CollectorRegistry()
    Gauge("gpuscaler_test_value", "A value the test set.", registry=registry).set(42)
    return registry


@pytest.fixture
def healthy() -> Healthy:
    """The server's health, serving at first."""
    return Healthy()


@pytest.fixture
async def server(registry: CollectorRegistry, healthy: Healthy) -> AsyncIterator[MetricsServer]:
    """A started server on a port the OS chose."""
    server = MetricsServer(registry, Address("127.0.0.1", 0), healthy=healthy)
    await server.start()
    yield server
    await server.stop()


def connection_refused(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_port_zero_reports_the_port_bound(server: MetricsServer) -> None:
    """Asked for port 0, the server reports the port the OS gave it, and answers there."""
    assert server.port != 0
    status, _, _ = await fetch(server.port, "/")
    assert status == 200


async def test_metrics_are_the_registrys_in_text_format(server: MetricsServer) -> None:
    """/metrics serves the registry in Prometheus' text format, parseable by the Prometheus client's parser."""
    status, content_type, body = await fetch(server.port, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    families = {family.name: family for family in text_string_to_metric_families(body.decode())}
    assert families["gpuscaler_test_value"].samples[0].value == 42


async def test_metrics_negotiate_openmetrics(server: MetricsServer) -> None:
    """A scraper that accepts OpenMetrics gets OpenMetrics, ending in # EOF."""
    accept = "application/openmetrics-text; version=1.0.0"
    status, content_type, body = await fetch(server.port, "/metrics", headers={"Accept": accept})
    assert status == 200
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


async def test_healthz_answers_200_serving_and_503_not_serving(server: MetricsServer, healthy: Healthy) -> None:
    """/healthz is 200 SERVING while healthy, 503 with the reason when not."""
    assert await fetch(server.port, "/healthz") == (200, "text/plain; charset=utf-8", b"SERVING\n")
    healthy.serving = False
    status, _, body = await fetch(server.port, "/healthz")
    assert (status, body) == (503, b"NOT_SERVING: no fresh sample of any GPU\n")


async def test_index_unknown_paths_and_methods(server: MetricsServer) -> None:
    """/ says where things are, an unknown path is 404, a POST is 405, and HEAD has headers only."""
    status, _, body = await fetch(server.port, "/")
    assert (status, body) == (200, b"gpuscaler: metrics at /metrics, health at /healthz\n")
    assert (await fetch(server.port, "/nothing-here"))[0] == 404
    assert (await fetch(server.port, "/metrics", method="POST"))[0] == 405
    assert (await fetch(server.port, "/healthz", method="HEAD"))[::2] == (200, b"")


async def test_an_oversized_request_is_refused(server: MetricsServer) -> None:
    """Headers beyond the request budget get 431, and the server goes on answering."""
    headers = {f"X-Filler-{n}": "x" * 1000 for n in range(10)}
    assert sum(len(k) + len(v) for k, v in headers.items()) > exposition.MAX_REQUEST_BYTES
    try:
        status, _, _ = await fetch(server.port, "/metrics", headers=headers)
    except ConnectionResetError:  # the refusal may close the connection before the client reads the 431
        status = 431
    assert status == 431
    assert (await fetch(server.port, "/metrics"))[0] == 200


async def test_a_silent_client_blocks_no_scrape_and_is_dropped(
    server: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that connects and sends nothing holds only its own connection, which closes after the timeout."""
    monkeypatch.setattr(exposition._Handler, "timeout", 0.2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
        assert (await fetch(server.port, "/metrics"))[0] == 200
        assert await asyncio.to_thread(silent.recv, 1) == b""  # closed by the server


async def test_connections_beyond_the_bound_are_closed(server: MetricsServer) -> None:
    """Past MAX_CONNECTIONS open connections, a new one is closed unanswered; a freed slot answers again."""

    def connect(count: int) -> list[socket.socket]:
        return [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(count)]

    silent = await asyncio.to_thread(connect, exposition.MAX_CONNECTIONS)
    try:
        await until(lambda: server.connections == exposition.MAX_CONNECTIONS)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as extra:
            extra.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                answer = await asyncio.to_thread(extra.recv, 100)
            except ConnectionResetError:
                answer = b""
            assert answer == b""
    finally:
        for connection in silent:
            connection.close()
    await until(lambda: server.connections == 0)  # each thread sees the end of its input and ends
    status, _, _ = await fetch(server.port, "/")
    assert status == 200


async def test_collectors_run_on_the_loop_thread(registry: CollectorRegistry, server: MetricsServer) -> None:
    """The registry is read on the event loop's thread, never on the connection's."""
    seen: list[int] = []

    class Recording(Collector):
        def collect(self) -> Iterator[GaugeMetricFamily]:
            seen.append(threading.get_ident())
            yield GaugeMetricFamily("gpuscaler_test_thread", "The thread that collected.", value=1)

    registry.register(Recording())
    assert (await fetch(server.port, "/metrics"))[0] == 200
    assert seen == [threading.get_ident()]


async def test_a_stuck_loop_is_a_503_not_a_hang(
    registry: CollectorRegistry, server: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the loop cannot answer within the deadline the scrape is a 503, and the next one answers again."""
    monkeypatch.setattr(exposition, "ANSWER_TIMEOUT_SECONDS", 0.2)
    release = threading.Event()
    answers: list[Response] = []

    class Stuck(Collector):
        def collect(self) -> Iterator[GaugeMetricFamily]:
            release.wait(10)  # holds the loop until the client has its answer
            yield GaugeMetricFamily("gpuscaler_test_stuck", "Answers once released.", value=1)

    def client() -> None:
        answers.append(get(server.port, "/metrics"))
        release.set()

    registry.register(Stuck())
    thread = threading.Thread(target=client)
    thread.start()
    await asyncio.to_thread(thread.join)
    assert answers[0][0] == 503
    assert (await fetch(server.port, "/metrics"))[0] == 200


async def test_stop_closes_the_port(registry: CollectorRegistry) -> None:
    """After stop nothing listens on the port, and an open connection has been ended."""
    server = MetricsServer(registry, Address("127.0.0.1", 0))
    await server.start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
        await until(lambda: server.connections == 1)
        await server.stop()
        assert await asyncio.to_thread(idle.recv, 1) == b""
    assert connection_refused(server.port)


async def test_a_port_in_use_names_the_flag(registry: CollectorRegistry, server: MetricsServer) -> None:
    """A port that cannot be bound is a StartupError naming --metrics-listen and the reason."""
    busy = MetricsServer(registry, Address("127.0.0.1", server.port))
    with pytest.raises(StartupError, match=rf"--metrics-listen 127\.0\.0\.1:{server.port}: cannot listen: "):
        await busy.start()
