"""The Prometheus /metrics endpoint and /healthz on prometheus_client's threaded WSGI server, answered by the loop.

/healthz answers 200 while samples are fresh and 503 otherwise, the same as the gRPC health service:
the kubelet's native gRPC probe speaks plaintext only, so with TLS on the gRPC port the chart probes here.

The HTTP side is prometheus_client's own (its ``ThreadingWSGIServer`` on the standard library's wsgiref),
not aiohttp: an agent that needs no HTTP client starts about 0.2 s sooner and 10 MiB smaller without it.
The event loop accepts connections (no thread polls the listener); each connection gets a daemon thread, so
a slow or stuck client holds only its own. The thread asks the loop for the answer, so the registry's
collectors read the process's state on the loop thread only, as everything else does; a scrape only formats
the newest snapshot and the counters, so it does not block the loop.

Bounded, so that no client can hold /healthz (the liveness probe) down; docs/security.md says why each:

- at most ``MAX_CONNECTIONS`` connections at once, ``MAX_CONNECTIONS_PER_PEER`` from one address, and the last
  ``RESERVED_CONNECTIONS`` only for an address with none open (the kubelet's probe, a scrape); more are closed
  unanswered;
- a request line and headers must arrive within ``HEADER_DEADLINE_SECONDS`` of the accept, however they trickle
  (408 after), and be at most ``MAX_REQUEST_BYTES`` (431 beyond);
- a client that sends or reads nothing for ``IDLE_TIMEOUT_SECONDS`` is dropped;
- an answer the loop does not give within ``ANSWER_TIMEOUT_SECONDS`` is a 503;
- when accept() fails for want of descriptors (EMFILE) the listener pauses, ``ACCEPT_BACKOFF_SECONDS`` at first,
  doubling to ``ACCEPT_BACKOFF_MAX_SECONDS``, instead of being woken again at once.

Each time a limit acts it counts (``gpuscaler_http_limited_total``, ``gpuscaler_accept_errors_total``) and logs,
one line per limit per interval (``server/overload.py``). One request per connection (HTTP/1.0), as Prometheus
and the kubelet expect of a metrics port.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import http.client
import io
import socket
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder

from gpuscaler.flags import Address
from gpuscaler.model.errors import StartupError
from gpuscaler.server.overload import HTTP_LIMITS, RESOURCE_ERRNOS, LimitCounts, LogEvery, errno_name

log = structlog.get_logger(__name__)

IDLE_TIMEOUT_SECONDS = 5.0
HEADER_DEADLINE_SECONDS = 5.0
ANSWER_TIMEOUT_SECONDS = 5.0
STOP_TIMEOUT_SECONDS = 1.0
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_PEER = 4
RESERVED_CONNECTIONS = 8
MAX_REQUEST_BYTES = 8 * 1024
ACCEPT_BACKOFF_SECONDS = 0.1
ACCEPT_BACKOFF_MAX_SECONDS = 1.0

INDEX_TEXT = b"gpuscaler: metrics at /metrics, health at /healthz\n"
TEXT = "text/plain; charset=utf-8"

# (status line, content type, body): what the loop answers a request with.
Answer = tuple[str, str, bytes]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]
# Called with the limit that acted and the peer's address, on the loop or on a connection's thread.
Limited = Callable[[str, str], None]


class MetricsServer:
    """Serves ``registry`` at ``/metrics``; ``start`` binds, ``stop`` closes the listener and every connection."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: Address,
        *,
        healthy: Callable[[], bool] | None = None,
        counts: LimitCounts | None = None,
    ) -> None:
        self._registry = registry
        self._address = address
        self._healthy = healthy
        self._counts = counts if counts is not None else LimitCounts.of_process()
        self._limit_logs = {limit: LogEvery("http_limited", limit=limit) for limit in HTTP_LIMITS}
        self._accept_log = LogEvery("accept_failed", listener="metrics")
        self._backoff = ACCEPT_BACKOFF_SECONDS
        self._resume: asyncio.TimerHandle | None = None
        self._server: _Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind and start accepting; StartupError names ``--metrics-listen`` when the port cannot be had."""
        self._loop = asyncio.get_running_loop()
        try:
            server = _Server(self._address, self._app, self.limited)
        except OSError as error:
            raise StartupError(f"--metrics-listen {self._address}: cannot listen: {error.strerror}") from None
        server.socket.setblocking(False)
        self._server = server
        self._loop.add_reader(server.socket, self._accept)
        self.port = int(server.server_address[1])

    @property
    def connections(self) -> int:
        """How many connections are open now."""
        return self._server.connection_count() if self._server is not None else 0

    @property
    def accepting(self) -> bool:
        """Whether the listener is taking connections now (not paused after an accept() failure)."""
        return self._server is not None and self._resume is None

    async def stop(self) -> None:
        """Stop accepting, give open connections ``STOP_TIMEOUT_SECONDS`` to be answered, then drop the rest."""
        server, self._server = self._server, None
        if server is None or self._loop is None:
            return
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._loop.remove_reader(server.socket)
        server.server_close()
        if not server.idle.is_set():
            # The answers in flight need the loop, so the wait for them runs on a thread rather than in a join.
            await asyncio.to_thread(server.idle.wait, STOP_TIMEOUT_SECONDS)
        server.drop_connections()

    def limited(self, limit: str, peer: str) -> None:
        """Count that ``limit`` acted on ``peer``, and log it unless it was logged within the interval."""
        self._counts.http_limited(limit)
        self._limit_logs[limit](peer=peer)

    def _accept(self) -> None:
        # The listener is readable: take one connection, or pause accepting when the process is out of descriptors.
        server = self._server
        if server is None:
            return
        try:
            server.accept()
        except OSError as error:
            if error.errno in RESOURCE_ERRNOS:
                self._pause(server, error)
            return  # otherwise gone before we took it, or another wake-up took it first
        self._backoff = ACCEPT_BACKOFF_SECONDS

    def _pause(self, server: _Server, error: OSError) -> None:
        # A listener with a connection waiting stays readable: accepting again now would fail again now, a spin.
        assert self._loop is not None
        self._counts.accept_failed("metrics", error)
        self._accept_log(
            errno=errno_name(error),
            retry_seconds=self._backoff,
            detail="cannot take a new connection (out of file descriptors or memory); accepting again later",
        )
        self._loop.remove_reader(server.socket)
        self._resume = self._loop.call_later(self._backoff, self._resume_accepting, server)
        self._backoff = min(self._backoff * 2, ACCEPT_BACKOFF_MAX_SECONDS)

    def _resume_accepting(self, server: _Server) -> None:
        self._resume = None
        if self._server is server and self._loop is not None:
            self._loop.add_reader(server.socket, self._accept)

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
            self.limited("answer_timeout", str(environ.get("REMOTE_ADDR", "")))
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


@dataclass(frozen=True, slots=True)
class _Slot:
    """One admitted connection: who, and when it was accepted (its header deadline counts from then)."""

    peer: str
    accepted_at: float


class _Server(ThreadingWSGIServer):
    """prometheus_client's thread-per-connection WSGI server, bounded, accepting from the event loop."""

    block_on_close = False  # stop() waits for the connections itself, with a deadline
    request_queue_size = 64  # connections the kernel holds until the loop takes them (socketserver's 5 is small)

    def __init__(self, address: Address, app: Callable[..., Iterable[bytes]], limited: Limited) -> None:
        infos = socket.getaddrinfo(address.host or None, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        self.address_family = family
        self.limited = limited
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, _Slot] = {}
        self._per_peer: Counter[str] = Counter()
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
        """Take one connection off the listener (called by the loop when it is readable) and start its thread.

        Raises the OSError of a failed accept(); a connection past a limit is closed unanswered and counted.
        """
        connection, client_address = self.get_request()
        peer = str(client_address[0])
        refused = self._admit(connection, peer)
        if refused is None:
            try:
                self.process_request(connection, client_address)
                return
            except RuntimeError:  # "can't start new thread": the process is at its thread limit
                self._release(connection)
                refused = "threads"
        self.shutdown_request(connection)
        self.limited(refused, peer)

    def _admit(self, connection: socket.socket, peer: str) -> str | None:
        # The limit that refuses ``connection`` from ``peer``, or None once it is admitted.
        with self._lock:
            total, mine = len(self._connections), self._per_peer[peer]
            if mine >= MAX_CONNECTIONS_PER_PEER:
                return "peer_connections"
            if total >= MAX_CONNECTIONS or (mine > 0 and total >= MAX_CONNECTIONS - RESERVED_CONNECTIONS):
                return "connections"
            self._connections[connection] = _Slot(peer, time.monotonic())
            self._per_peer[peer] += 1
            self.idle.clear()
        return None

    def _release(self, connection: socket.socket) -> None:
        with self._lock:
            slot = self._connections.pop(connection, None)
            if slot is not None:
                self._per_peer[slot.peer] -= 1
                if not self._per_peer[slot.peer]:
                    del self._per_peer[slot.peer]
            if not self._connections:
                self.idle.set()

    def accepted_at(self, connection: socket.socket) -> float:
        """When ``connection`` was accepted (now, for one not admitted here)."""
        with self._lock:
            slot = self._connections.get(connection)
        return slot.accepted_at if slot is not None else time.monotonic()

    def connection_count(self) -> int:
        """How many connections are open now."""
        with self._lock:
            return len(self._connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        # ThreadingMixIn's, with the loop's context variables (the log's node) in the thread as well.
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run, args=(self.process_request_thread, request, client_address), daemon=True
        )
        thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

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


class _HeadersLate(TimeoutError):
    """The request line and headers did not all arrive within HEADER_DEADLINE_SECONDS of the accept."""


class _Handler(WSGIRequestHandler):
    """wsgiref's request handler with a header deadline, a read budget, an idle timeout and no access log."""

    timeout = IDLE_TIMEOUT_SECONDS
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain buffered stream: the request is read through the deadline and the budget
        deadline = self.server.accepted_at(self.connection) + HEADER_DEADLINE_SECONDS
        self._reader = _DeadlineReader(self.connection, deadline, idle_seconds=self.timeout)
        self.rfile = _Budget(io.BufferedReader(self._reader), MAX_REQUEST_BYTES)

    def handle(self) -> None:
        # WSGIRequestHandler.handle, with the limits' outcomes answered and counted, and wsgiref's handler quiet.
        try:
            self.raw_requestline = self.rfile.readline(MAX_REQUEST_BYTES + 1)
            if not self.parse_request():  # it has answered (400, 431)
                return
        except _HeadersLate:
            self._limited("header_deadline")
            self._answer_and_close("408 Request Timeout", b"the request headers did not arrive in time\n")
            return
        except TimeoutError:
            self._limited("idle_timeout")
            return
        app = self.server.get_app()
        assert app is not None
        output = cast(IO[bytes], self.wfile)
        handler = _ServerHandler(self.rfile, output, self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self
        try:
            handler.run(app)
        except TimeoutError:  # the client read nothing of the answer for IDLE_TIMEOUT_SECONDS
            self._limited("idle_timeout")

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        finally:
            # The headers are in (or refused): the deadline is for them only; the answer has the idle timeout.
            self._reader.deadline = None
            self.connection.settimeout(self.timeout)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        if code == http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:  # over MAX_REQUEST_BYTES, or over 100 headers
            self._limited("request_bytes")
        super().send_error(code, message, explain)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _limited(self, limit: str) -> None:
        self.server.limited(limit, str(self.client_address[0]))

    def _answer_and_close(self, status: str, body: bytes) -> None:
        head = f"HTTP/1.0 {status}\r\nContent-Type: {TEXT}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        with contextlib.suppress(OSError):
            self.connection.settimeout(1.0)  # a client that does not read its 408 holds its thread no longer
            self.connection.sendall(head.encode("ascii") + body)


class _ServerHandler(ServerHandler):
    """wsgiref's handler, which prints a traceback to stderr for any error: a client's broken connection is its own
    problem, and anything else goes to the log as one event."""

    request_handler: WSGIRequestHandler  # wsgiref's ServerHandler.close reads it to log the request

    def log_exception(self, exc_info: Any) -> None:
        if isinstance(exc_info[1], OSError):
            return
        log.error("metrics_request_failed", exc_info=exc_info)


class _DeadlineReader(socket.SocketIO):
    """A socket's raw input that fails with ``_HeadersLate`` once ``deadline`` (monotonic) has passed.

    The buffered reader above it receives a line in as many reads as the client takes: the socket timeout (the idle
    timeout) starts again at each byte, so alone it would let a client that sends one byte a second hold a
    connection for ever. Each read here waits only as long as the deadline leaves; ``None`` turns it off.
    """

    def __init__(self, connection: socket.socket, deadline: float, *, idle_seconds: float) -> None:
        super().__init__(connection, "rb")
        self._connection = connection
        self._idle_seconds = idle_seconds
        self.deadline: float | None = deadline

    def readinto(self, buffer: Any) -> int | None:
        deadline = self.deadline
        if deadline is None:
            return super().readinto(buffer)
        left = deadline - time.monotonic()
        if left <= 0:
            raise _HeadersLate("request headers")
        self._connection.settimeout(min(self._idle_seconds, left))
        try:
            return super().readinto(buffer)
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise _HeadersLate("request headers") from None
            raise


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
