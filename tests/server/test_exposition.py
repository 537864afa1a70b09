"""The /metrics and /healthz HTTP server, driven over real sockets by the standard library's HTTP client."""

from __future__ import annotations

import asyncio
import errno
import http.client
import itertools
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpuscaler.flags import Address
from gpuscaler.model.errors import StartupError
from gpuscaler.server import bounded_http, exposition
from gpuscaler.server.exposition import MetricsServer
from gpuscaler.server.overload import LimitCounts
from tests.waiting import until

Response = tuple[int, str, bytes]


def get(
    port: int, path: str, *, method: str = "GET", headers: dict[str, str] | None = None, source: str = "127.0.0.1"
) -> Response:
    """Status, Content-Type and body of one request from ``source`` (blocking: run it on a thread)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
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
def counts() -> LimitCounts:
    """The server's own counts of the limits that acted (not the process's, which other tests share)."""
    return LimitCounts()


@pytest.fixture
async def server(registry: CollectorRegistry, healthy: Healthy, counts: LimitCounts) -> AsyncIterator[MetricsServer]:
    """A started server on a port the OS chose."""
    server = MetricsServer(registry, Address("127.0.0.1", 0), healthy=healthy, counts=counts)
    await server.start()
    yield server
    await server.stop()


def connect_from(port: int, source: str, count: int = 1) -> list[socket.socket]:
    """``count`` connections to ``port`` from the loopback address ``source`` (another peer than 127.0.0.1)."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) for _ in range(count)]


def closed_unanswered(connection: socket.socket) -> bool:
    """Whether the server closes ``connection`` without answering a request on it."""
    try:
        connection.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return connection.recv(100) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def read_all(connection: socket.socket) -> bytes:
    """Everything the server sends on ``connection`` until it closes it."""
    chunks = []
    while chunk := connection.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


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


async def test_an_oversized_request_is_refused(server: MetricsServer, counts: LimitCounts) -> None:
    """Headers beyond the request budget get 431 and count, and the server goes on answering."""
    headers = {f"X-Filler-{n}": "x" * 1000 for n in range(10)}
    assert sum(len(k) + len(v) for k, v in headers.items()) > bounded_http.MAX_REQUEST_BYTES
    try:
        status, _, _ = await fetch(server.port, "/metrics", headers=headers)
    except ConnectionResetError:  # the refusal may close the connection before the client reads the 431
        status = 431
    assert status == 431
    assert (await fetch(server.port, "/metrics"))[0] == 200
    assert counts.http["request_bytes"] == 1


async def test_a_silent_client_blocks_no_scrape_and_is_dropped(
    server: MetricsServer, counts: LimitCounts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that connects and sends nothing holds only its own connection, which closes after the timeout."""
    monkeypatch.setattr(bounded_http._Handler, "timeout", 0.2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
        assert (await fetch(server.port, "/metrics"))[0] == 200
        assert await asyncio.to_thread(silent.recv, 1) == b""  # closed by the server
    await until(lambda: counts.http["idle_timeout"] == 1)


def trickle(port: int, every_seconds: float, *, give_up_after: float = 10.0) -> tuple[float, bytes]:
    """Send a request line, then one header byte each ``every_seconds``, never ending the headers.

    The seconds until the server closed the connection, and what it answered.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        started = time.monotonic()
        connection.sendall(b"GET /metrics HTTP/1.0\r\nX-Slow: ")
        connection.settimeout(every_seconds)
        answer = b""
        while time.monotonic() - started < give_up_after:
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                try:
                    connection.sendall(b"a")
                except OSError:
                    break
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        return time.monotonic() - started, answer


async def test_the_header_deadline_is_not_reset_by_trickled_bytes(
    server: MetricsServer, counts: LimitCounts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends a header byte every 0.1 s (well inside the idle timeout) is answered 408 and closed at
    the header deadline, counted; a request that arrives whole is not affected."""
    monkeypatch.setattr(bounded_http, "HEADER_DEADLINE_SECONDS", 0.6)
    assert bounded_http._Handler.timeout == bounded_http.IDLE_TIMEOUT_SECONDS == 5.0
    seconds, answer = await asyncio.to_thread(trickle, server.port, 0.1)
    assert 0.6 <= seconds < 2.0
    assert answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n"), answer
    assert counts.http["header_deadline"] == 1
    assert counts.http["idle_timeout"] == 0
    assert (await fetch(server.port, "/healthz"))[0] == 200


async def test_one_peer_cannot_hold_healthz_down(server: MetricsServer, counts: LimitCounts) -> None:
    """One peer's silent connections past MAX_CONNECTIONS_PER_PEER each displace that peer's oldest, counted; it
    holds its share only, and /healthz from another address answers meanwhile."""
    per_peer = bounded_http.MAX_CONNECTIONS_PER_PEER
    held = await asyncio.to_thread(connect_from, server.port, "127.0.0.2", 3 * per_peer)
    try:
        await until(lambda: counts.http["displaced"] == 2 * per_peer)
        assert server.connections == per_peer
        for _ in range(3):
            assert (await fetch(server.port, "/healthz"))[0] == 200
        for displaced in held[: 2 * per_peer]:
            assert await asyncio.to_thread(closed_unanswered, displaced)
        assert counts.http["peer_connections"] == 0
    finally:
        for connection in held:
            connection.close()
    await until(lambda: server.connections == 0)


async def test_connections_beyond_the_bound_are_closed(
    server: MetricsServer, counts: LimitCounts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_CONNECTIONS open connections, a newcomer closes the oldest whose headers are still to come, counted,
    and is answered."""
    monkeypatch.setattr(bounded_http, "MAX_CONNECTIONS", 6)
    monkeypatch.setattr(bounded_http, "RESERVED_CONNECTIONS", 0)
    silent = [
        *await asyncio.to_thread(connect_from, server.port, "127.0.0.2", 4),
        *await asyncio.to_thread(connect_from, server.port, "127.0.0.3", 2),
    ]
    try:
        await until(lambda: server.connections == 6)
        assert (await fetch(server.port, "/healthz", source="127.0.0.4"))[0] == 200
        assert await asyncio.to_thread(closed_unanswered, silent[0])
        assert counts.http["displaced"] == 1
        assert counts.http["connections"] == 0
    finally:
        for connection in silent:
            connection.close()
    await until(lambda: server.connections == 0)  # each thread sees the end of its input and ends
    status, _, _ = await fetch(server.port, "/")
    assert status == 200


async def test_the_reserve_is_for_peers_with_no_connection_open(
    server: MetricsServer, counts: LimitCounts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last RESERVED_CONNECTIONS slots go only to a peer with none open: the kubelet's probe still gets in when
    peers that already hold connections have taken the rest."""
    monkeypatch.setattr(bounded_http, "MAX_CONNECTIONS", 6)
    monkeypatch.setattr(bounded_http, "RESERVED_CONNECTIONS", 2)
    held = [
        *await asyncio.to_thread(connect_from, server.port, "127.0.0.2", 2),
        *await asyncio.to_thread(connect_from, server.port, "127.0.0.3", 2),
    ]
    try:
        await until(lambda: server.connections == 4)
        held += await asyncio.to_thread(connect_from, server.port, "127.0.0.2")  # past the unreserved slots
        await until(lambda: counts.http["displaced"] == 1)  # it took the place of the oldest silent one
        assert server.connections == 4
        assert (await fetch(server.port, "/healthz"))[0] == 200  # 127.0.0.1 holds none: a reserved slot
        held += await asyncio.to_thread(connect_from, server.port, "127.0.0.4")
        await until(lambda: server.connections == 5)
        assert (await fetch(server.port, "/healthz"))[0] == 200  # the last slot
    finally:
        for connection in held:
            connection.close()
    await until(lambda: server.connections == 0)


def test_only_connections_still_sending_headers_give_way_and_the_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admission displaces the oldest connection whose headers are still to come (of the newcomer's own address
    at its cap); where every connection has sent its headers, the newcomer is refused by the limit instead."""
    monkeypatch.setattr(bounded_http, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(bounded_http, "MAX_CONNECTIONS_PER_PEER", 2)
    monkeypatch.setattr(bounded_http, "RESERVED_CONNECTIONS", 0)
    server = bounded_http.BoundedWsgiServer(Address("127.0.0.1", 0), lambda *_: [b""], lambda *_: None)
    pairs = [socket.socketpair() for _ in range(6)]
    a1, a2, b1, a3, c1, c2 = (ours for ours, _ in pairs)
    try:
        assert server._admit(a1, "a") == (None, None)
        assert server._admit(a2, "a") == (None, None)
        server.headers_arrived(a1)
        assert server._admit(b1, "b") == (None, None)
        refused, displaced = server._admit(a3, "a")  # at a's cap: a's own oldest still waiting, a2 (not a1)
        assert refused is None
        assert displaced is not None
        assert displaced[0] is a2
        server.headers_arrived(a3)
        refused, displaced = server._admit(c1, "c")  # the pool is full: the oldest still waiting anywhere, b1
        assert refused is None
        assert displaced is not None
        assert displaced[0] is b1
        assert server.connection_count() == 3
        server.headers_arrived(c1)
        assert server._admit(c2, "c") == ("connections", None)  # every one has sent its headers
        assert server._admit(c2, "a") == ("peer_connections", None)
    finally:
        server.server_close()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_the_peer_with_the_most_connections_still_sending_headers_gives_way_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the pool full, a newcomer displaces the oldest waiting connection of the peer with the most of them,
    not the oldest of all: a lone probe that is slow to be read outlasts many slow clients of one address."""
    monkeypatch.setattr(bounded_http, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(bounded_http, "RESERVED_CONNECTIONS", 0)
    server = bounded_http.BoundedWsgiServer(Address("127.0.0.1", 0), lambda *_: [b""], lambda *_: None)
    pairs = [socket.socketpair() for _ in range(4)]
    probe, slow1, slow2, newcomer = (ours for ours, _ in pairs)
    try:
        assert server._admit(probe, "kubelet") == (None, None)
        assert server._admit(slow1, "slow") == (None, None)
        assert server._admit(slow2, "slow") == (None, None)
        refused, displaced = server._admit(newcomer, "other")
        assert refused is None
        assert displaced is not None
        assert displaced[0] is slow1
    finally:
        server.server_close()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


async def test_accept_out_of_descriptors_backs_off_instead_of_spinning(
    server: MetricsServer, counts: LimitCounts, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """While accept() fails with EMFILE the listener pauses 0.1 s, then 0.2, 0.4, ... (not a retry per wake-up of
    a listener that stays readable), counts each failure and logs one line; the waiting client is then answered."""
    failures: list[float] = []
    failing = True
    accept = bounded_http.BoundedWsgiServer.get_request

    def exhausted(self: bounded_http.BoundedWsgiServer) -> tuple[socket.socket, object]:
        if failing:
            failures.append(time.monotonic())
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    monkeypatch.setattr(bounded_http.BoundedWsgiServer, "get_request", exhausted)
    waiting = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with waiting:
        waiting.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        await until(lambda: len(failures) >= 4)
        assert not server.accepting
        pauses = [later - earlier for earlier, later in itertools.pairwise(failures)]
        for pause, backoff in zip(pauses, (0.1, 0.2, 0.4), strict=False):
            assert backoff - 0.01 <= pause < backoff + 0.5, pauses
        failing = False
        answer = await asyncio.to_thread(read_all, waiting)
    assert answer.startswith(b"HTTP/1.0 200 OK\r\n"), answer
    await until(lambda: server.accepting)
    assert counts.accept_errors[("metrics", "EMFILE")] == len(failures) <= 5
    logged = [line for line in capfd.readouterr().err.splitlines() if "accept_failed" in line]
    assert len(logged) == 1, logged
    assert "errno=EMFILE" in logged[0]
    assert "listener=metrics" in logged[0]


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
    registry: CollectorRegistry, server: MetricsServer, counts: LimitCounts, monkeypatch: pytest.MonkeyPatch
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
    assert counts.http["answer_timeout"] == 1
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
