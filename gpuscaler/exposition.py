"""The Prometheus /metrics endpoint and /healthz, served over HTTP/1.1 on the agent's own event loop.

/healthz answers 200 while samples are fresh and 503 otherwise, the same as the gRPC health service:
the kubelet's native gRPC probe speaks plaintext only, so with TLS on the gRPC port the chart probes here.

Bounded: a request head may be 8 KiB and its body 1 KiB; a connection gets 5 s for each request and
closes when idle that long. A scrape only formats the newest snapshot and the counters, so it runs on
the loop without blocking it.

Three GET routes need no web framework: a small asyncio server answers them. aiohttp was most of the
agent's start-up time and a fifth of its memory, for these three routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscaler.errors import StartupError
from gpuscaler.flags import Address

KEEPALIVE_TIMEOUT_SECONDS = 5.0
MAX_HEAD_BYTES = 8 * 1024
MAX_BODY_BYTES = 1024
SHUTDOWN_TIMEOUT_SECONDS = 1.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Request Entity Too Large",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TEXT = "text/plain; charset=utf-8"


class _Refusal(Exception):
    """A request we answer with ``status``; after a malformed one the connection closes."""

    def __init__(self, status: int, text: str, *, malformed: bool = True) -> None:
        super().__init__(text)
        self.status = status
        self.text = text
        self.malformed = malformed


class MetricsServer:
    """Serves ``registry`` at ``/metrics``; ``start`` binds, ``stop`` closes every connection."""

    def __init__(
        self, registry: CollectorRegistry, address: Address, *, healthy: Callable[[], bool] | None = None
    ) -> None:
        self._registry = registry
        self._address = address
        self._healthy = healthy
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._serve_connection, self._address.host, self._address.port, limit=MAX_HEAD_BYTES
            )
        except OSError as error:
            raise StartupError(f"--metrics-listen {self._address}: cannot listen: {error.strerror}") from None
        if self._server.sockets:
            self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in self._connections:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_SECONDS):
                await asyncio.gather(*self._connections, return_exceptions=True)
                await self._server.wait_closed()
        self._server = None

    def _respond(self, method: str, path: str, accept: str) -> tuple[int, str, bytes]:
        """Status, content type and body for a request; raises _Refusal for what is not served."""
        routes = {"/metrics", "/"} | ({"/healthz"} if self._healthy is not None else set())
        if path not in routes:
            raise _Refusal(404, "404: Not Found", malformed=False)
        if method not in ("GET", "HEAD"):
            raise _Refusal(405, "405: Method Not Allowed", malformed=False)
        if path == "/metrics":
            encoder, content_type = choose_encoder(accept)
            return 200, content_type, encoder(self._registry)
        if path == "/healthz":
            assert self._healthy is not None
            if self._healthy():
                return 200, _TEXT, b"SERVING\n"
            return 503, _TEXT, b"NOT_SERVING: no fresh sample of any GPU\n"
        return 200, _TEXT, b"gpuscaler agent: metrics at /metrics\n"

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while await self._serve_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away, or was idle or slow for KEEPALIVE_TIMEOUT_SECONDS
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _serve_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection stays open for the next."""
        try:
            async with asyncio.timeout(KEEPALIVE_TIMEOUT_SECONDS):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return await _send(writer, 431, _TEXT, b"431: Request Header Fields Too Large", head_only=False, keep=False)
        except asyncio.IncompleteReadError as error:
            if error.partial.strip():
                await _send(writer, 400, _TEXT, b"400: Bad Request", head_only=False, keep=False)
            return False
        method, keep = "", False
        try:
            method, path, version, headers = _parse_head(head)
            keep = _keep_alive(version, headers)
            await _discard_body(reader, headers)
            status, content_type, body = self._respond(method, path, headers.get("accept", ""))
        except _Refusal as refusal:
            keep = keep and not refusal.malformed
            return await _send(
                writer, refusal.status, _TEXT, refusal.text.encode(), head_only=method == "HEAD", keep=keep
            )
        return await _send(writer, status, content_type, body, head_only=method == "HEAD", keep=keep)


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """The method, the path without its query, the HTTP version and the headers (lower-case names)."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise _Refusal(400, "400: Bad Request") from None
    if not version.startswith("HTTP/1."):
        raise _Refusal(505, "505: HTTP Version Not Supported")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _Refusal(400, "400: Bad Request")
        headers[name.lower()] = value.strip()
    return method, target.partition("?")[0], version, headers


def _keep_alive(version: str, headers: dict[str, str]) -> bool:
    """HTTP/1.1 keeps the connection unless the client says close; HTTP/1.0 only if it asks."""
    tokens = {token.strip() for token in headers.get("connection", "").lower().split(",")}
    if version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


async def _discard_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    """Read and drop a request body of at most MAX_BODY_BYTES; none of the routes reads one."""
    if "transfer-encoding" in headers:
        raise _Refusal(400, "400: Bad Request: send a body with Content-Length")
    length_text = headers.get("content-length", "0")
    if not length_text.isdigit():
        raise _Refusal(400, "400: Bad Request: Content-Length is not a number")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise _Refusal(413, f"413: the request body is {length} bytes; at most {MAX_BODY_BYTES} are accepted")
    if length:
        async with asyncio.timeout(KEEPALIVE_TIMEOUT_SECONDS):
            await reader.readexactly(length)


async def _send(
    writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes, *, head_only: bool, keep: bool
) -> bool:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") if head_only else head.encode("latin-1") + body)
    await writer.drain()
    return keep
