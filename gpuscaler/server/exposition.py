"""The Prometheus /metrics endpoint and /healthz, answered by the event loop.

/healthz answers 200 while samples are fresh and 503 otherwise, the same as the gRPC health service:
the kubelet's native gRPC probe speaks plaintext only, so with TLS on the gRPC port the chart probes here.

The HTTP side is prometheus_client's own threaded WSGI server, bounded (``bounded_http.py`` says how), not
aiohttp: an agent that needs no HTTP client starts about 0.2 s sooner and 10 MiB smaller without it. The event
loop accepts connections (no thread polls the listener); each connection gets a daemon thread, so a slow or
stuck client holds only its own. The thread asks the loop for the answer, so the registry's collectors read the
process's state on the loop thread only, as everything else does; a scrape only formats the newest snapshot and
the counters, so it does not block the loop. An answer the loop does not give within ``ANSWER_TIMEOUT_SECONDS``
is a 503, and when accept() fails for want of descriptors (EMFILE) the listener pauses,
``ACCEPT_BACKOFF_SECONDS`` at first, doubling to ``ACCEPT_BACKOFF_MAX_SECONDS``, instead of being woken again at
once. Each time a limit acts it counts (``gpuscaler_http_limited_total``, ``gpuscaler_accept_errors_total``) and
logs, one line per limit per interval (``server/overload.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscaler.flags import Address
from gpuscaler.model.errors import StartupError
from gpuscaler.server.bounded_http import TEXT, BoundedWsgiServer
from gpuscaler.server.overload import HTTP_LIMITS, RESOURCE_ERRNOS, LimitCounts, LogEvery, errno_name

log = structlog.get_logger(__name__)


ANSWER_TIMEOUT_SECONDS = 5.0
STOP_TIMEOUT_SECONDS = 1.0
ACCEPT_BACKOFF_SECONDS = 0.1
ACCEPT_BACKOFF_MAX_SECONDS = 1.0

INDEX_TEXT = b"gpuscaler: metrics at /metrics, health at /healthz\n"

# (status line, content type, body): what the loop answers a request with.
Answer = tuple[str, str, bytes]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


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
        self._server: BoundedWsgiServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind and start accepting; StartupError names ``--metrics-listen`` when the port cannot be had."""
        self._loop = asyncio.get_running_loop()
        try:
            server = BoundedWsgiServer(self._address, self._app, self.limited)
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

    def _pause(self, server: BoundedWsgiServer, error: OSError) -> None:
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

    def _resume_accepting(self, server: BoundedWsgiServer) -> None:
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
