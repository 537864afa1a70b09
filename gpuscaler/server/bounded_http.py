"""prometheus_client's thread-per-connection WSGI server, bounded so that no client can hold /healthz down.

The liveness probe and Prometheus share this port with anyone who can reach it; docs/security.md says why each
bound is what it is:

- at most ``MAX_CONNECTIONS`` connections at once, ``MAX_CONNECTIONS_PER_PEER`` from one address, and the last
  ``RESERVED_CONNECTIONS`` only for an address with none open (the kubelet's probe, a scrape); past a limit, the
  oldest connection whose request headers have not all arrived (of the newcomer's own address, for the per-address
  limit) is closed to make room, and only where every connection has sent its headers is the newcomer closed
  unanswered;
- a request line and headers must arrive within ``HEADER_DEADLINE_SECONDS`` of the accept, however they trickle
  (408 after), and be at most ``MAX_REQUEST_BYTES`` (431 beyond);
- a client that sends or reads nothing for ``IDLE_TIMEOUT_SECONDS`` is dropped.

One request per connection (HTTP/1.0), as Prometheus and the kubelet expect of a metrics port.
"""

from __future__ import annotations

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
from prometheus_client.exposition import ThreadingWSGIServer

from gpuscaler.flags import Address

log = structlog.get_logger(__name__)


IDLE_TIMEOUT_SECONDS = 5.0
HEADER_DEADLINE_SECONDS = 5.0
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_PEER = 4
RESERVED_CONNECTIONS = 8
MAX_REQUEST_BYTES = 8 * 1024

TEXT = "text/plain; charset=utf-8"

# Called with the limit that acted and the peer's address, on the loop or on a connection's thread.
Limited = Callable[[str, str], None]


@dataclass(slots=True)
class _Slot:
    """One admitted connection: who, when it was accepted (its header deadline counts from then), and whether
    its request headers are still to come (only then can a newcomer displace it)."""

    peer: str
    accepted_at: float
    waiting: bool = True


class BoundedWsgiServer(ThreadingWSGIServer):
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
        refused, displaced = self._admit(connection, peer)
        if displaced is not None:
            victim, slot = displaced
            # Its thread's read ends at once and the thread closes it; a client that sends its request in one
            # segment (the kubelet, Prometheus) is past its headers within a millisecond and never displaced.
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)
            self.limited("displaced", slot.peer)
        if refused is None:
            try:
                self.process_request(connection, client_address)
                return
            except RuntimeError:  # "can't start new thread": the process is at its thread limit
                self._release(connection)
                refused = "threads"
        self.shutdown_request(connection)
        self.limited(refused, peer)

    def _admit(self, connection: socket.socket, peer: str) -> tuple[str | None, tuple[socket.socket, _Slot] | None]:
        # The limit that refuses ``connection`` from ``peer`` (None once it is admitted), and the connection it
        # displaced to get in, if any (forgotten here; the caller closes it).
        with self._lock:
            total, mine = len(self._connections), self._per_peer[peer]
            displaced = None
            if mine >= MAX_CONNECTIONS_PER_PEER:
                displaced = self._oldest_waiting(peer)
                if displaced is None:
                    return "peer_connections", None
            elif total >= MAX_CONNECTIONS or (mine > 0 and total >= MAX_CONNECTIONS - RESERVED_CONNECTIONS):
                displaced = self._oldest_waiting(None)
                if displaced is None:
                    return "connections", None
            if displaced is not None:
                self._forget(displaced[0])
            self._connections[connection] = _Slot(peer, time.monotonic())
            self._per_peer[peer] += 1
            self.idle.clear()
        return None, displaced

    def _oldest_waiting(self, peer: str | None) -> tuple[socket.socket, _Slot] | None:
        # The earliest admitted connection whose headers are still to come: of ``peer`` if given, else of the peer
        # with the most such connections (slow clients from many addresses displace each other before the
        # kubelet's one probe). Under the lock.
        waiting = [(connection, slot) for connection, slot in self._connections.items() if slot.waiting]
        if peer is None and waiting:
            counts = Counter(slot.peer for _, slot in waiting)
            most = max(counts.values())
            return next((c, slot) for c, slot in waiting if counts[slot.peer] == most)
        return next(((c, slot) for c, slot in waiting if slot.peer == peer), None)

    def headers_arrived(self, connection: socket.socket) -> None:
        """``connection``'s request headers are in (or refused): from now on no newcomer displaces it."""
        with self._lock:
            slot = self._connections.get(connection)
            if slot is not None:
                slot.waiting = False

    def _forget(self, connection: socket.socket) -> None:
        # Under the lock.
        slot = self._connections.pop(connection, None)
        if slot is not None:
            self._per_peer[slot.peer] -= 1
            if not self._per_peer[slot.peer]:
                del self._per_peer[slot.peer]
        if not self._connections:
            self.idle.set()

    def _release(self, connection: socket.socket) -> None:
        with self._lock:
            self._forget(connection)

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
    server: BoundedWsgiServer

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
            self.server.headers_arrived(self.connection)
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
