"""The Prometheus /metrics endpoint and /healthz on prometheus_client's threaded WSGI server, answered by the loop.

/healthz answers 200 while samples are fresh and 503 otherwise, the same as the gRPC health service:
the kubelet's native gRPC probe speaks plaintext only, so with TLS on the gRPC port the chart probes here.

The HTTP side is prometheus_client's own (its ``ThreadingWSGIServer`` on the standard library's wsgiref),
not aiohttp: an agent that needs no HTTP client starts about 0.2 s sooner and 10 MiB smaller without it.
The event loop accepts connections (no thread polls the listener); each connection gets a daemon thread, so
a slow or stuck client holds only its own. The thread asks the loop for the answer, so the registry's
collectors read the process's state on the loop thread only, as everything else does; a scrape only formats
the newest snapshot and the counters, so it does not block the loop.

Bounded: at most ``MAX_CONNECTIONS`` connections at once (more are closed unanswered), a request line and
headers of at most ``MAX_REQUEST_BYTES`` (431 beyond), a client that sends or reads nothing for
``IDLE_TIMEOUT_SECONDS`` is dropped, and an answer the loop does not give within ``ANSWER_TIMEOUT_SECONDS``
is a 503. One request per connection (HTTP/1.0), as Prometheus and the kubelet expect of a metrics port.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder

from gpuscaler.errors import StartupError
from gpuscaler.flags import Address

IDLE_TIMEOUT_SECONDS = 5.0
ANSWER_TIMEOUT_SECONDS = 5.0
STOP_TIMEOUT_SECONDS = 1.0
MAX_CONNECTIONS = 16
MAX_REQUEST_BYTES = 8 * 1024

INDEX_TEXT = b"gpuscaler: metrics at /metrics, health at /healthz\n"
TEXT = "text/plain; charset=utf-8"

# (status line, content type, body): what the loop answers a request with.
Answer = tuple[str, str, bytes]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class MetricsServer:
    """Serves ``registry`` at ``/metrics``; ``start`` binds, ``stop`` closes the listener and every connection."""

    def __init__(
        self, registry: CollectorRegistry, address: Address, *, healthy: Callable[[], bool] | None = None
    ) -> None:
        self._registry = registry
        self._address = address
        self._healthy = healthy
        self._server: _Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind and start accepting; StartupError names ``--metrics-listen`` when the port cannot be had."""
        self._loop = asyncio.get_running_loop()
        try:
            server = _Server(self._address, self._app)
        except OSError as error:
            raise StartupError(f"--metrics-listen {self._address}: cannot listen: {error.strerror}") from None
        server.socket.setblocking(False)
        self._loop.add_reader(server.socket, server.accept)
        self._server = server
        self.port = int(server.server_address[1])

    @property
    def connections(self) -> int:
        """How many connections are open now."""
        return self._server.connection_count() if self._server is not None else 0

    async def stop(self) -> None:
        """Stop accepting, give open connections ``STOP_TIMEOUT_SECONDS`` to be answered, then drop the rest."""
        server, self._server = self._server, None
        if server is None or self._loop is None:
            return
        self._loop.remove_reader(server.socket)
        server.server_close()
        if not server.idle.is_set():
            # The answers in flight need the loop, so the wait for them runs on a thread rather than in a join.
            await asyncio.to_thread(server.idle.wait, STOP_TIMEOUT_SECONDS)
        server.drop_connections()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        # The WSGI application; runs on the connection's thread, and only waits there for the loop's answer.
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
            status, content_type, body = "405 Method Not Allowed", TEXT, b"only GET and HEAD\n"
        else:
            status, content_type, body = self._answer_from_loop(environ.get("PATH_INFO", ""), environ)
        start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [b""] if environ["REQUEST_METHOD"] == "HEAD" else [body]

    def _answer_from_loop(self, path: str, environ: dict[str, Any]) -> Answer:
        assert self._loop is not None
        try:
            future = asyncio.run_coroutine_threadsafe(self._answer(path, environ.get("HTTP_ACCEPT", "")), self._loop)
        except RuntimeError:  # the loop has closed: the process is stopping
            return "503 Service Unavailable", TEXT, b"stopping\n"
        try:
            return future.result(timeout=ANSWER_TIMEOUT_SECONDS)
        except TimeoutError:
            future.cancel()
            return "503 Service Unavailable", TEXT, b"the agent did not answer in time\n"
        except asyncio.CancelledError:  # cancelled by the loop's shutdown
            return "503 Service Unavailable", TEXT, b"stopping\n"

    async def _answer(self, path: str, accept: str) -> Answer:
        if path == "/metrics":
            encoder, content_type = choose_encoder(accept)
            return "200 OK", content_type, encoder(self._registry)
        if path == "/healthz" and self._healthy is not None:
            if self._healthy():
                return "200 OK", TEXT, b"SERVING\n"
            return "503 Service Unavailable", TEXT, b"NOT_SERVING: no fresh sample of any GPU\n"
        if path == "/":
            return "200 OK", TEXT, INDEX_TEXT
        return "404 Not Found", TEXT, b"not found: metrics at /metrics, health at /healthz\n"


class _Server(ThreadingWSGIServer):
    """prometheus_client's thread-per-connection WSGI server, bounded, accepting from the event loop."""

    block_on_close = False  # stop() waits for the connections itself, with a deadline
    request_queue_size = 64  # connections the kernel holds until the loop takes them (socketserver's 5 is small)

    def __init__(self, address: Address, app: Callable[..., Iterable[bytes]]) -> None:
        infos = socket.getaddrinfo(address.host or None, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        self.address_family = family
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self.idle = threading.Event()
        self.idle.set()
        super().__init__((str(sockaddr[0]), int(sockaddr[1])), _Handler)
        self.set_app(app)

    def server_bind(self) -> None:
        # http.server's server_bind asks DNS for the host's full name (socket.getfqdn), which can stall a start
        # for seconds where reverse DNS is slow; the WSGI environ's SERVER_NAME is the address itself instead.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()

    def accept(self) -> None:
        """Take one connection off the listener (called by the loop when it is readable) and start its thread."""
        try:
            connection, client_address = self.get_request()
        except OSError:  # gone before we took it, or another wake-up took it first
            return
        with self._lock:
            full = len(self._connections) >= MAX_CONNECTIONS
            if not full:
                self._connections.add(connection)
                self.idle.clear()
        if full:
            self.shutdown_request(connection)
            return
        self.process_request(connection, client_address)

    def connection_count(self) -> int:
        """How many connections are open now."""
        with self._lock:
            return len(self._connections)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._connections.discard(request)
                if not self._connections:
                    self.idle.set()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out, reset or sent garbage is its own problem; socketserver would print a traceback.
        pass

    def drop_connections(self) -> None:
        """End every connection still open: its thread's next read or write fails and it closes."""
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class _Handler(WSGIRequestHandler):
    """wsgiref's request handler with a read budget, an idle timeout and no access log."""

    timeout = IDLE_TIMEOUT_SECONDS

    def setup(self) -> None:
        super().setup()
        self.rfile = _Budget(self.rfile, MAX_REQUEST_BYTES)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Budget(io.BufferedIOBase):
    """A request stream that refuses to read past ``limit`` bytes, so a huge header block is a 431, not memory.

    http.server reads the request line and headers through ``readline``; a header line that would cross the
    budget raises the same ``LineTooLong`` as one over its own limit, which it answers with 431.
    """

    def __init__(self, stream: io.BufferedIOBase, limit: int) -> None:
        super().__init__()
        self._stream = stream
        self._left = limit

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> bytes:
        size = -1 if size is None else size
        if self._left <= 0:
            raise http.client.LineTooLong("request headers")
        line = self._stream.readline(self._left if size < 0 else min(size, self._left))
        self._left -= len(line)
        return line

    def read(self, size: int | None = -1) -> bytes:
        size = -1 if size is None else size
        data = self._stream.read(self._left if size < 0 else min(size, self._left))
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._stream.close()
        super().close()
