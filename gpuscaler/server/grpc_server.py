"""A grpclib Server that accepts KEDA's way of using one connection for everything.

KEDA multiplexes every ScaledObject's calls and push streams over ONE HTTP/2 connection per scaler
address. h2 announces MAX_CONCURRENT_STREAMS = 100, so the 101st open StreamIsActive would make every
later call from KEDA wait. grpclib has no setting for it; we raise it to ``--max-streams`` the way grpclib
itself raises INITIAL_WINDOW_SIZE, with a SETTINGS update right after the connection preface.

Neither grpclib nor h2 bounds what a peer may hold or send. ``ConnectionLimits`` do, here and in
``connection_limits`` (docs/security.md lists each limit and the upstream report): a stream past the limit
is refused alone, floods and protocol errors get a GOAWAY before the close, and a peer that does not read
is not read either. TLS is done per connection (``_TlsAccepting``), so a rotated context revokes sessions.

After ``close()`` grpclib still starts a handler for every request that arrives on an open connection,
and as the process exits those handlers never run ("Task was destroyed but it is pending!"). Ours
refuses such requests with RST_STREAM REFUSED_STREAM, which gRPC clients know was not processed.

grpclib reads a request's gRPC frame with an ``assert`` on its length and a NotImplementedError for the
compressed flag, and the generated handlers assert that a request message came; all three reached the
client as UNKNOWN and our log as "Application error". The request is at fault, so we answer
INVALID_ARGUMENT and UNIMPLEMENTED instead. grpclib also takes in a message of any declared size: we
refuse one over MAX_RECEIVE_MESSAGE_BYTES with RESOURCE_EXHAUSTED before reading its body, and a header
block over MAX_HEADER_LIST_BYTES closes the connection before it is decoded.

With thousands of streams open on that one connection, h2 and grpclib walk every stream for each
call (h2 counts open streams per new stream, grpclib wakes every stream per connection-level
WINDOW_UPDATE and rebuilds its task table every 10 calls), and every frame is its own socket write.
The classes below keep the same behaviour at a cost per call that does not grow with open streams,
and send one write per turn of the event loop; bench/results/compare*.json have the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import ssl
from asyncio import sslproto
from collections.abc import Callable, Collection, Iterator
from typing import Any, Literal, cast

import grpclib.server
from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec, ProtoStatusDetailsCodec, _googleapis_available
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, decode_timeout
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, Stream, _set_nodelay
from grpclib.server import Handler as ConnectionHandler
from grpclib.server import Server, request_handler
from grpclib.server import Stream as ServerStream
from grpclib.utils import DeadlineWrapper
from h2.connection import H2Connection, _decode_headers
from h2.errors import ErrorCodes
from h2.events import (
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamReset,
    UnknownFrameReceived,
    WindowUpdated,
)
from h2.exceptions import ProtocolError, TooManyStreamsError
from h2.frame_buffer import FrameBuffer
from h2.settings import SettingCodes
from h2.stream import StreamClosedBy
from hyperframe.frame import HeadersFrame, RstStreamFrame

from gpuscaler.flags import ConnectionLimits
from gpuscaler.generated.externalscaler import GetMetricsRequest, GetMetricsResponse, ScaledObjectRef
from gpuscaler.generated.gpuscaler.v1 import Snapshot as AgentSnapshot
from gpuscaler.server.connection_limits import CALL_RESERVE, PINGS_PER_CALL, ConnectionGuard, TokenBucket
from gpuscaler.server.lean_streams import LeanEvent, LeanStream

# Every request we serve is a ScaledObjectRef or smaller: a name (at most 253 bytes), a namespace (63) and
# the trigger's metadata, about twenty short keys; a large real one (a long podSelector) is under 1 KiB.
# grpclib has no limit of its own and decodes on the event loop, where betterproto2 spends ~16 us per map
# entry: 8 KiB of the smallest entries (~1,200) holds the loop for ~20 ms, 4 MiB would hold it for seconds
# and every sample would go stale. bench/stall.py measures the worst an accepted request does.
MAX_RECEIVE_MESSAGE_BYTES = 8 * 1024
# The same reasoning for the request's HTTP/2 header block: KEDA sends a handful of short headers, and
# h2 decodes the whole block (its default allows 64 KiB, ~25 ms of HPACK) in one callback. gRPC's own
# servers default to 8 KiB of metadata too. A larger block closes the connection.
MAX_HEADER_LIST_BYTES = 8 * 1024
# HPACK can shrink a header list, so the encoded block may be a little larger than the list it decodes to.
MAX_HEADER_BLOCK_BYTES = 2 * MAX_HEADER_LIST_BYTES
# How many streams may close between two of h2's walks over every stream (see _H2Connection).
SWEEP_EVERY_STREAMS = 512
# KEDA's requests, decoded once per distinct bytes (see _ReusingCodec): at most this many, each at most this long.
REUSED_REQUESTS: frozenset[type[Any]] = frozenset({ScaledObjectRef, GetMetricsRequest})
REUSE_ENTRIES = 1024
REUSE_MAX_BYTES = 4096
# Answers a handler gives out again as the same, never-changed message object (ExternalScalerService,
# AgentService's snapshot without windows): encoded once.
REUSED_ANSWERS: frozenset[type[Any]] = frozenset({GetMetricsResponse, AgentSnapshot})
# At most this much of what a peer sent is taken in per turn of the event loop (_ManyStreamsProtocol._feed).
FEED_BYTES = 4 * 1024
# After a GOAWAY toward a peer cut off for a flood, how long it has to read it before the socket is dropped.
GOAWAY_GRACE_SECONDS = 1.0
# A reset this soon after its stream opened counts against --max-resets-per-second (see _stream_reset).
RAPID_RESET_SECONDS = 1.0
# A call with less than this left of its deadline when it starts cannot be answered in time.
EXPIRED_WITHIN_SECONDS = 0.001


class _DeadlineWrapper(DeadlineWrapper):
    """grpclib's deadline, which cancels the call when it passes, even when it passed before the call began.

    grpclib's ``start`` raises TimeoutError outside the wrapper that turns it into DEADLINE_EXCEEDED when no
    time is left (docs/security.md, item 5), and no precheck can close that race: the process can be
    descheduled between ours in ``_H2Connection._handle`` and grpclib's. Scheduling the cancel for "now"
    instead lets grpclib's own handling answer DEADLINE_EXCEEDED.
    """

    @contextlib.contextmanager
    def start(self, deadline: Deadline) -> Iterator[None]:
        timer = asyncio.get_running_loop().call_later(
            max(deadline.time_remaining(), 0.0), self.cancel, TimeoutError("Deadline exceeded")
        )
        try:
            yield
        finally:
            timer.cancel()


grpclib.server.DeadlineWrapper = _DeadlineWrapper  # type: ignore[attr-defined]  # the name request_handler looks up


class _H2Connection(H2Connection):
    """h2's connection, without a walk over every stream for each new one, refusing a stream past the limit.

    h2 counts the open inbound streams for every HEADERS frame that opens a stream, by walking every
    stream it holds (and dropping the closed ones as it goes). With KEDA's push streams on the
    connection that walk is most of a call's cost: 10,000 open streams make every GetMetrics walk
    10,000 streams. The count only decides whether the new stream passes MAX_CONCURRENT_STREAMS,
    and it is never above the number of streams held, so while that number is under the limit the
    answer cannot change: the walk runs only when the limit could be reached, and once every
    SWEEP_EVERY_STREAMS new streams so that closed ones are still dropped.

    A stream past the limit is a connection error in h2 (TooManyStreamsError), which would drop every
    call and push stream of the KEDA that sent it. RFC 9113 (5.1.2) allows the stream error instead:
    the stream is reset with REFUSED_STREAM, which gRPC clients know was not processed and retry.
    """

    _sweep_at = 0  # len(self.streams) at which the next walk runs
    on_refused: Callable[[], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incoming_buffer = _BoundedFrameBuffer(server=not self.config.client_side)

    @property
    def open_inbound_streams(self) -> int:
        held = len(self.streams)
        if held < self._sweep_at and held < self.local_settings.max_concurrent_streams:
            return held  # an upper bound, under the limit: the decision is the walk's
        count = super().open_inbound_streams
        self._sweep_at = len(self.streams) + SWEEP_EVERY_STREAMS
        return count

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Any], list[Any]]:
        try:
            return cast(tuple[list[Any], list[Any]], super()._receive_headers_frame(frame))
        except TooManyStreamsError:
            if frame.stream_id <= self.highest_inbound_stream_id:
                raise  # not a new stream at all: a reused id is the peer's protocol error
        # The header block still updates HPACK's table, which the peer's later blocks rely on.
        _decode_headers(self.decoder, frame.data)
        self.highest_inbound_stream_id = max(self.highest_inbound_stream_id, frame.stream_id)
        # As a stream we reset: h2 answers the stream's further frames with RST_STREAM, not a connection error.
        self._closed_streams[frame.stream_id] = StreamClosedBy.SEND_RST_STREAM
        refusal = RstStreamFrame(frame.stream_id)
        refusal.error_code = ErrorCodes.REFUSED_STREAM
        if self.on_refused is not None:
            self.on_refused()
        return [refusal], []


class _BoundedFrameBuffer(FrameBuffer):
    """h2's frame buffer, refusing a header block before it grows past MAX_HEADER_BLOCK_BYTES undecoded.

    h2 joins a HEADERS frame and its CONTINUATIONs before decoding them and allows 64 frames of up to 16 KiB:
    about 1 MiB a connection held for a block MAX_HEADER_LIST_BYTES would refuse anyway (200 connections took
    the agent past its memory limit). A block past the bound is the peer's protocol error.
    """

    def _update_header_buffer(self, f: Any) -> Any:
        frame = super()._update_header_buffer(f)
        if self._headers_buffer and sum(len(part.data) for part in self._headers_buffer) > MAX_HEADER_BLOCK_BYTES:
            raise ProtocolError(f"a header block of more than {MAX_HEADER_BLOCK_BYTES} bytes")
        return frame


class _CoalescingTransport:
    """The connection's transport, sending everything written in one turn of the event loop as one write.

    grpclib writes to the socket for each frame it sends: a unary answer is three writes (headers,
    data, trailers), each a send() system call and, with TCP_NODELAY, a packet. Those writes were
    the largest item in the agent's profile under GetMetrics load. Here they are joined and sent at
    the end of the turn, so a call costs one write, and concurrent calls answered in the same turn
    share one. The order of the bytes does not change, and nothing waits longer than the turn.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        # Set when the server cuts the peer off: close() then only ends our side, so the GOAWAY is read
        # before the socket goes (closing with the peer's data unread would reset the connection and lose it).
        self.linger = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._transport.write(data)

    def close(self) -> None:
        self._flush()  # what was written before close() still goes out first, as it would have
        if not self.linger:
            self._transport.close()
        elif self._transport.can_write_eof():
            self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)  # is_closing, get_extra_info, ...


class _WindowWait(LeanEvent):
    """A stream's ``window_updated``, known to its connection while the stream waits on it."""

    def __init__(self, waiting: set[_WindowWait]) -> None:
        super().__init__()
        self._waiting = waiting

    async def wait(self) -> Literal[True]:
        self._waiting.add(self)
        try:
            return await super().wait()
        finally:
            self._waiting.discard(self)


class _Connection(Connection):
    """grpclib's connection, keeping the streams that wait for flow-control window.

    On a WINDOW_UPDATE for the whole connection grpclib wakes every stream it holds; with 10,000
    push streams that is 10,000 ``Event.set()`` calls, and a grpc client sends one with most calls.
    Only a stream blocked in ``send_data`` waits on that event (it clears it just before), so
    waking just the waiting ones is the same.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_waiting: set[_WindowWait] = set()

    def create_stream(self, *, stream_id: int | None = None, wrapper: Any = None) -> Stream:
        window = _WindowWait(self.window_waiting)
        return LeanStream(self, self._connection, self._transport, window, stream_id=stream_id, wrapper=wrapper)


class _ManyStreamsProtocol(H2Protocol):
    """grpclib's protocol with our connection classes, and the per-connection half of ConnectionLimits.

    It counts the peer's resets and PINGs/SETTINGS into token buckets (past them: GOAWAY
    ENHANCE_YOUR_CALM), sends GOAWAY before closing on a protocol error (grpclib closes without it), stops
    reading from a peer while our output to it is past ``write_buffer_limit_bytes`` (so a peer that never
    reads cannot make us buffer ACKs without bound), and tells the guard's sweep when it last had a
    stream and whether its preface came.
    """

    def __init__(self, handler: ConnectionHandler, config: Any, h2_config: Any, guard: ConnectionGuard) -> None:
        super().__init__(handler, config, h2_config)
        self.guard = guard
        now = guard.clock()
        self.accepted_at = now
        self.last_stream_at = now
        self.preface_done = False
        self.admitted = False  # True once the guard counts this connection
        self.write_stalled_since: float | None = None
        self.peer = "?"
        self._discarding = False
        self._backlog: list[memoryview] | None = None  # what a read brought beyond FEED_BYTES, still to take in
        self._paused: set[str] = set()  # why reading is paused: "write" (peer not reading), "backlog"
        self._raw: asyncio.Transport | None = None
        self._resets = TokenBucket(guard.limits.max_resets_per_second, now)
        self._pings = TokenBucket(guard.limits.max_pings_per_second, now)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Count this connection against max_connections; False (and the socket dropped) when it is past it."""
        self._raw = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        if not self.guard.admit_connection(self):
            self.discard()
            return False
        self.admitted = True
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.admitted and not self.admit(transport):
            return
        self._grpclib_connection_made(transport)
        limits = self.guard.limits
        cast(asyncio.WriteTransport, transport).set_write_buffer_limits(high=limits.write_buffer_limit_bytes)
        h2_connection = self.connection._connection  # grpclib keeps the H2Connection private
        h2_connection.update_settings(
            {
                SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams + CALL_RESERVE,
                SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
            }
        )
        # h2 applies an announced limit once the peer acknowledges it; a client that never does is held to it too.
        h2_connection.decoder.max_header_list_size = MAX_HEADER_LIST_BYTES
        cast(_H2Connection, h2_connection).on_refused = self._refused
        self.connection.flush()
        # HTTP/2 peers must ignore frames of unknown types (RFC 9113 section 4.1); grpclib has no processor
        # for h2's UnknownFrameReceived and kills the connection with NotImplementedError instead.
        processors = cast(dict[type[Any], Any], self.processor.processors)
        processors[UnknownFrameReceived] = _ignore
        processors[WindowUpdated] = self._window_updated
        processors[RequestReceived] = functools.partial(self._request_received, processors[RequestReceived])
        processors[StreamReset] = functools.partial(self._stream_reset, processors[StreamReset])
        processors[PingReceived] = self._ping_received
        processors[RemoteSettingsChanged] = functools.partial(
            self._settings_received, processors[RemoteSettingsChanged]
        )

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return  # cut off: only waiting for the peer to read our GOAWAY
        if self._backlog is not None:
            self._backlog.append(memoryview(data))  # TLS had more decrypted before reading paused: after the rest
            return
        self._feed(memoryview(data))

    def _feed(self, data: memoryview) -> None:
        """Take in at most FEED_BYTES now, and the rest in later turns of the loop, not reading meanwhile.

        One read can hold 256 KiB of frames: thousands of calls or resets handled in one callback, while
        every other caller and the poll loop wait. In slices, other connections take their turns between.
        """
        if len(data) > FEED_BYTES:
            self._backlog = [data[FEED_BYTES:]]
            data = data[:FEED_BYTES]
            self._pause_reading("backlog")
            asyncio.get_running_loop().call_soon(self._feed_backlog)
        self._take_in(bytes(data))

    def _feed_backlog(self) -> None:
        backlog, self._backlog = self._backlog, None
        if backlog is None or self._discarding:
            return
        rest = memoryview(b"".join(backlog))
        if len(rest) <= FEED_BYTES:
            self._resume_reading("backlog")
        self._feed(rest)

    def _take_in(self, data: bytes) -> None:
        try:
            events = self.connection.feed(data)
        except ProtocolError as error:
            # h2 has queued a GOAWAY with the error's code; grpclib would close without sending it.
            self.guard.act("protocol_error", self.peer, error=str(error)[:200])
            self.connection.flush()
            self._close_soon()
            return
        self.connection.flush()
        for event in events:
            self.processor.process(event)
        if not self.connection.is_closing():  # an event may have cut the peer off
            self.connection.flush()

    def _request_received(self, accept: Callable[[RequestReceived], None], event: RequestReceived) -> None:
        self.last_stream_at = self.guard.clock()
        self._pings.give(PINGS_PER_CALL)
        accept(event)
        stream = self.processor.streams.get(event.stream_id)
        if isinstance(stream, LeanStream) and stream.created is not None:
            for name, value in cast(list[tuple[str, str]], event.headers):
                if name == "grpc-timeout":
                    with contextlib.suppress(ValueError):  # grpclib answers a bad one itself
                        stream.deadline_at = stream.created + decode_timeout(value)
                    break

    def _stream_reset(self, reset: Callable[[StreamReset], None], event: StreamReset) -> None:
        # Only a reset soon after its stream opened counts: that is the rapid-reset attack, a stream the server
        # starts work for and the peer drops at once, bypassing the stream limit. KEDA cancelling push streams
        # it held for minutes (a ScaledObject deleted, the operator stopping) is no flood, however many at once.
        stream = self.processor.streams.get(event.stream_id)
        now = self.guard.clock()
        reset(event)
        if (
            event.remote_reset
            and stream is not None
            and stream.created is not None
            and now - stream.created < RAPID_RESET_SECONDS
            # A client cancelling a call whose deadline has passed (grpc-go and grpcio do, on a slow server) is
            # no attack: the server would end that call now anyway.
            and not (isinstance(stream, LeanStream) and stream.deadline_at is not None and now >= stream.deadline_at)
            and not self._resets.take(now)
        ):
            self._calm("reset_flood", f"more than {self.guard.limits.max_resets_per_second} rapid resets a second")

    def _ping_received(self, event: PingReceived) -> None:
        if not self._pings.take(self.guard.clock()):
            self._calm("ping_flood", f"more than {self.guard.limits.max_pings_per_second} PINGs and SETTINGS a second")

    def _settings_received(
        self, changed: Callable[[RemoteSettingsChanged], None], event: RemoteSettingsChanged
    ) -> None:
        changed(event)
        if not self.preface_done:
            self.preface_done = True  # the client's first SETTINGS completes its connection preface
        elif not self._pings.take(self.guard.clock()):
            self._calm("ping_flood", f"more than {self.guard.limits.max_pings_per_second} PINGs and SETTINGS a second")

    def _refused(self) -> None:
        self.guard.act("max_streams", self.peer, per_connection=self.guard.limits.max_streams + CALL_RESERVE)

    def _calm(self, limit: str, reason: str) -> None:
        """GOAWAY ENHANCE_YOUR_CALM and close: the peer sends more than any real client does."""
        if self.connection.is_closing():
            return
        self.guard.act(limit, self.peer)
        self._go_away(ErrorCodes.ENHANCE_YOUR_CALM, reason)
        self._close_soon()

    def go_away_idle(self) -> None:
        """GOAWAY NO_ERROR and close: gRPC clients open a new connection when they next need one."""
        self._go_away(ErrorCodes.NO_ERROR, "idle")
        self._close_soon()

    def _go_away(self, code: ErrorCodes, reason: str) -> None:
        with contextlib.suppress(ProtocolError):  # h2 has already sent one
            self.connection._connection.close_connection(code, additional_data=reason.encode())
        self.connection.flush()

    def _close_soon(self) -> None:
        """End every call and stop serving; the socket closes once the peer has had time to read the GOAWAY.

        Until then what the peer sends is read and dropped; GOAWAY_GRACE_SECONDS later the socket goes,
        whether the peer closed its side or not.
        """
        self.guard.release_connection(self)
        self._discarding = True
        cast(_CoalescingTransport, self.connection._transport).linger = True
        self.processor.close("Connection closed by the server")
        raw = self._raw
        if raw is not None:
            asyncio.get_running_loop().call_later(GOAWAY_GRACE_SECONDS, raw.abort)  # a no-op once closed

    def abort(self) -> None:
        """Drop the socket now; its handler closes with it."""
        if self._raw is not None:
            self._raw.abort()
        self.handler.close()  # one that never got to HTTP/2 would otherwise stay in the server's set for ever

    def discard(self) -> None:
        """Give up on a connection that never got to HTTP/2 (refused, or its TLS handshake failed)."""
        self.guard.release_connection(self)
        self.abort()

    def open_streams(self) -> int:
        processor = getattr(self, "processor", None)
        return len(processor.streams) if processor is not None else 0

    def pause_writing(self) -> None:
        # The peer is not reading what we send: read nothing more from it until it does, so nothing it sends
        # (PINGs, SETTINGS, calls) can make us buffer more; the guard closes it past write_timeout_seconds.
        super().pause_writing()
        self.write_stalled_since = self.guard.clock()
        self._pause_reading("write")

    def resume_writing(self) -> None:
        super().resume_writing()
        self.write_stalled_since = None
        self._resume_reading("write")

    def _pause_reading(self, reason: str) -> None:
        if not self._paused and self._raw is not None:
            self._raw.pause_reading()
        self._paused.add(reason)

    def _resume_reading(self, reason: str) -> None:
        self._paused.discard(reason)
        if not self._paused and self._raw is not None and not self._raw.is_closing():
            self._raw.resume_reading()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.release_connection(self)
        self._discarding, self._backlog = True, None  # a backlog still scheduled must not feed a closed connection
        if hasattr(self, "processor"):
            super().connection_lost(exc)

    def _window_updated(self, event: WindowUpdated) -> None:
        if event.stream_id == 0:
            for waiting in list(cast(_Connection, self.connection).window_waiting):
                waiting.set()
        else:
            stream = self.processor.streams.get(event.stream_id)
            if stream is not None:
                stream.window_updated.set()

    def _grpclib_connection_made(self, transport: asyncio.BaseTransport) -> None:
        # grpclib 0.4.9's H2Protocol.connection_made (pinned), with our H2Connection in place of h2's
        # and our transport around the socket's.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _set_nodelay(sock)
        h2_conn = _H2Connection(config=self.h2_config)
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        stream_delta = self.config.http2_stream_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        if stream_delta:
            h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size})
        coalescing = _CoalescingTransport(cast(asyncio.Transport, transport))
        self.connection = _Connection(h2_conn, cast(asyncio.Transport, coalescing), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)


class _TlsAccepting(asyncio.Protocol):
    """A new TCP connection's first protocol: TLS with the context of the moment its ClientHello comes, then HTTP/2.

    asyncio's server TLS is one context for the listener's life, and session tickets and the session cache
    belong to it: a client resuming a session made before a CA rotation would get in without its certificate
    being checked again. Here each handshake uses the context ``contexts()`` gives at that moment, so a
    rotation brings a fresh context, whose tickets and cache know no earlier session (docs/tls.md).

    Nothing of TLS exists until the client's first bytes: a connection that never sends a ClientHello costs
    what a plaintext one does, until the guard's handshake timeout closes it.
    """

    def __init__(self, inner: _ManyStreamsProtocol, contexts: Callable[[], ssl.SSLContext]) -> None:
        self._inner = inner
        self._contexts = contexts
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._inner.admit(transport):
            self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None:
            return
        self._transport = None  # from here on the TLS protocol reads, and tells ``inner`` once it is up
        loop = asyncio.get_running_loop()
        handshake = loop.create_future()
        handshake.add_done_callback(self._handshake_done)
        tls = _TlsProtocol(
            loop,
            self._inner,
            self._contexts(),
            handshake,
            server_side=True,
            # The guard's sweep enforces the handshake timeout; this is only asyncio's own backstop.
            ssl_handshake_timeout=math.ceil(self._inner.guard.limits.handshake_timeout_seconds) + 1,
        )
        transport.set_protocol(tls)
        tls.connection_made(transport)
        view = memoryview(data)
        while view:  # what has come so far (the ClientHello), as the transport would hand it over
            buffer = tls.get_buffer(len(view))
            size = min(len(buffer), len(view))
            buffer[:size] = view[:size]
            tls.buffer_updated(size)
            view = view[size:]

    def _handshake_done(self, handshake: asyncio.Future[None]) -> None:
        if handshake.cancelled() or handshake.exception() is not None:
            self._inner.discard()  # a failed handshake is the client's; its alert told it why

    def connection_lost(self, exc: BaseException | None) -> None:
        self._inner.discard()


class _TlsProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol with a 16 KiB read buffer instead of 256 KiB: one TLS record, read at a time.

    Its buffer is allocated for the connection's life, so with asyncio's size 200 TLS connections took 60 MiB.
    """

    max_size = 16 * 1024


def _ignore(event: object) -> None:
    pass


class _RefusingHandler(ConnectionHandler):
    """grpclib's per-connection handler: a call past max_streams or during the close is refused, and each call
    is forgotten the moment it ends.

    grpclib rebuilds its table of request tasks every 10 requests to drop finished ones: with 10,000 push
    streams open, that is 1,000 tasks looked at per call. Ours drops each request's task from the table as
    it finishes, so the table holds only calls in progress and what a finished call made dies with it (kept
    for a later rebuild, it was promoted to the oldest generation, where full collections walked it: 40 ms
    each under GetMetrics load, 4 ms without). grpclib also keeps every task it cancels (a stream the peer
    reset) in a set that only that rebuild empties: each leaves it here when it finishes, so after any number
    of resets (CVE-2023-44487's rapid reset, or KEDA cancelling) no task, stream or message is held.

    A call whose deadline has passed (or is within EXPIRED_WITHIN_SECONDS) when it starts is answered
    DEADLINE_EXCEEDED here, before grpclib builds anything for it; one that runs out between this check and
    grpclib's is cancelled by ``_DeadlineWrapper``.
    """

    def __init__(self, *args: Any, guard: ConnectionGuard, expired: Callable[[str], None]) -> None:
        super().__init__(*args)
        self._guard = guard
        self._expired = expired

    def __gc_step__(self) -> None:
        pass  # nothing finished stays in the table or the cancelled set: no rebuild is needed

    def accept(self, stream: Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        streaming = self._is_streaming(headers)
        if self.closing or not self._guard.admit_stream(streaming=streaming):
            if not self.closing:
                self._guard.act("max_streams", _peer_of(stream), open=self._guard.streams)
            stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
            release_stream()
            return
        release = _Once(release_stream)
        task = self.loop.create_task(self._handle(stream, headers, release))
        self._tasks[stream] = task
        task.add_done_callback(functools.partial(self._finished, stream, release, streaming))

    def _is_streaming(self, headers: Any) -> bool:
        for name, value in headers:
            if name == ":path":
                method = self.mapping.get(value)  # an unknown path is answered UNIMPLEMENTED, a unary call
                return method is not None and bool(method.cardinality.server_streaming)
        return False

    async def _handle(self, stream: Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        deadline = Deadline.from_headers(headers)
        if deadline is not None and deadline.time_remaining() < EXPIRED_WITHIN_SECONDS:
            try:
                await _answer_deadline_exceeded(stream)
            finally:
                release_stream()
            self._expired(dict(headers).get(":path", ""))
            return
        await request_handler(
            self.mapping, stream, headers, self.codec, self.status_details_codec, self.dispatch, release_stream
        )

    def _finished(self, stream: Stream, release: _Once, streaming: bool, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step (the peer's RST_STREAM came in the same read as its
        # HEADERS) never ran the handler's own release: grpclib would hold the stream for the connection's life.
        release()
        self._guard.release_stream(streaming=streaming)
        if self._tasks.get(stream) is task:
            del self._tasks[stream]
        self._cancelled.discard(task)

    def cancel(self, stream: Stream) -> None:
        task = self._tasks.pop(stream, None)
        if task is not None:
            task.cancel()
            self._cancelled.add(task)  # until it has run its cleanup; _finished takes it out

    @property
    def tasks(self) -> int:
        """Request tasks alive on this connection, cancelled ones that have not finished included."""
        return len(self._tasks) + len(self._cancelled)


class _Once:
    """``release_stream`` that does its work the first time only: grpclib's pops the stream, once."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], Any]) -> None:
        self._release: Callable[[], Any] | None = release

    def __call__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


async def _answer_deadline_exceeded(stream: Stream) -> None:
    await stream.send_headers(
        [
            (":status", "200"),
            ("content-type", "application/grpc"),  # grpc-go reads an answer without it as UNKNOWN
            ("grpc-status", str(Status.DEADLINE_EXCEEDED.value)),
            ("grpc-message", "the deadline passed before the call could start"),
        ],
        end_stream=True,
    )
    if stream.closable:
        stream.reset_nowait()


def _peer_of(stream: Stream) -> str:
    peer = stream.connection._transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


def _guard_framing(guard: ConnectionGuard) -> Callable[[RecvRequest], Any]:
    """The RecvRequest listener that puts our checks around reading each call's request message."""
    request_timeout = guard.limits.request_timeout_seconds

    async def on_request(event: RecvRequest) -> None:
        handler = event.method_func

        async def guarded(stream: ServerStream[Any, Any]) -> None:
            receive = stream.recv_message
            _limit_message_size(stream)

            async def recv_message() -> Any:
                try:
                    async with asyncio.timeout(request_timeout):
                        message = await receive()
                except TimeoutError:
                    guard.act("request_timeout", _peer_of(stream._stream), seconds=request_timeout)
                    raise GRPCError(
                        Status.DEADLINE_EXCEEDED,
                        f"the request message did not arrive within {request_timeout:g} s of its headers",
                    ) from None
                except NotImplementedError:  # grpclib: "Compression not implemented"
                    raise GRPCError(
                        Status.UNIMPLEMENTED, "compressed messages are not supported; send them uncompressed"
                    ) from None
                except AssertionError:  # grpclib: the body is shorter than the frame's declared length
                    raise GRPCError(
                        Status.INVALID_ARGUMENT, "the request ended before the length its gRPC frame declares"
                    ) from None
                if message is None:  # every method we serve takes exactly one request message
                    raise GRPCError(Status.INVALID_ARGUMENT, "the request has no message; send exactly one")
                return message

            stream.recv_message = recv_message  # type: ignore[method-assign]
            await handler(stream)

        event.method_func = guarded

    return on_request


def _limit_message_size(stream: ServerStream[Any, Any]) -> None:
    """Refuse a request whose gRPC frame declares more than MAX_RECEIVE_MESSAGE_BYTES, before reading it."""
    h2_stream = stream._stream  # grpclib's protocol stream; its recv_data feeds grpclib's recv_message
    read = h2_stream.recv_data
    first = True

    async def recv_data(size: int) -> bytes:
        nonlocal first
        data = await read(size)
        if first and size == 5 and len(data) == 5:  # the 5-byte prefix: compressed flag, then the length
            declared = int.from_bytes(data[1:], "big")
            if declared > MAX_RECEIVE_MESSAGE_BYTES:
                raise GRPCError(
                    Status.RESOURCE_EXHAUSTED,
                    f"the request message is {declared} bytes; at most {MAX_RECEIVE_MESSAGE_BYTES} are accepted",
                )
        first = False
        return data

    h2_stream.recv_data = recv_data  # type: ignore[method-assign]


class _ReusingCodec(ProtoCodec):
    """grpclib's protobuf codec, decoding each distinct KEDA request once and encoding each reused answer once.

    KEDA sends every ScaledObject's IsActive, GetMetricSpec and GetMetrics requests with the same
    bytes at every poll, and decoding one with betterproto2 took about 90 us of a call's 900 on
    the 2-core machine. Equal bytes decode to equal messages, so those requests (up to
    REUSE_MAX_BYTES) are kept, the oldest of REUSE_ENTRIES dropped first. The handlers that get
    them only read them (ExternalScalerService), so one message can serve many calls. The other way,
    ExternalScalerService gives the same GetMetrics answer object until the value moves (REUSED_ANSWERS),
    and its bytes are kept with it, as betterproto2 took about 28 us to encode one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._decoded: dict[tuple[type[Any], bytes], Any] = {}
        # By id(): betterproto2 messages are not hashable. The entry keeps its message alive, so the id is
        # not reused by another object while the entry is here, and the ``is`` check below stays exact.
        self._encoded: dict[int, tuple[Any, bytes]] = {}

    def encode(self, message: Any, message_type: type[Any]) -> bytes:
        if message_type not in REUSED_ANSWERS:
            return super().encode(message, message_type)
        kept = self._encoded.get(id(message))
        if kept is not None and kept[0] is message:
            return kept[1]
        data = super().encode(message, message_type)
        if len(self._encoded) >= REUSE_ENTRIES:
            del self._encoded[next(iter(self._encoded))]
        self._encoded[id(message)] = (message, data)
        return data

    def decode(self, data: bytes, message_type: type[Any]) -> Any:
        if message_type not in REUSED_REQUESTS or len(data) > REUSE_MAX_BYTES:
            return super().decode(data, message_type)
        key = (message_type, bytes(data))
        message = self._decoded.get(key)
        if message is None:
            message = super().decode(data, message_type)
            if len(self._decoded) >= REUSE_ENTRIES:
                del self._decoded[next(iter(self._decoded))]
            self._decoded[key] = message
        return message


async def _unimplemented(method_name: str, stream: ServerStream[Any, Any]) -> None:
    raise GRPCError(Status.UNIMPLEMENTED, f"Method not found: {method_name}")


class _AnswerUnknownMethods(dict[str, Handler]):
    """The method table, answering a method it lacks with a handler that says UNIMPLEMENTED.

    grpclib answers an unknown method itself, but without a content-type, which grpc-go clients (KEDA,
    which opens StreamMetricSpec on every external scaler since 2.21) read as UNKNOWN "malformed header".
    Through a handler the answer is a proper gRPC one. The request is never read.
    """

    def get(self, method_name: str, default: Handler | None = None) -> Handler:  # type: ignore[override]  # never None
        found = super().get(method_name)
        if found is not None:
            return found
        return Handler(functools.partial(_unimplemented, method_name), Cardinality.UNARY_UNARY, object, object)


class ManyStreamsServer(Server):
    """``grpclib.server.Server`` with the limits of ``ConnectionLimits``, TLS by the context of each handshake."""

    def __init__(
        self,
        handlers: Collection[Any],
        limits: ConnectionLimits,
        *,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        # grpclib's defaults when it picks the codec, with ours in place of its ProtoCodec.
        super().__init__(
            handlers,
            codec=_ReusingCodec(),
            status_details_codec=ProtoStatusDetailsCodec() if _googleapis_available() else None,
        )
        self._mapping = _AnswerUnknownMethods(self._mapping)
        self.guard = ConnectionGuard(limits)
        self._tls = tls
        # Who to tell about a call answered DEADLINE_EXCEEDED before it started (its :path).
        self.on_expired: list[Callable[[str], None]] = []
        listen(self, RecvRequest, _guard_framing(self.guard))

    def close(self) -> None:
        self.guard.close()
        super().close()

    @property
    def handler_tasks(self) -> int:
        """Request tasks alive over every connection, cancelled ones that have not finished included."""
        return sum(cast(_RefusingHandler, handler).tasks for handler in self._handlers)

    @property
    def open_streams(self) -> int:
        """Streams grpclib holds over every connection."""
        return sum(cast(_ManyStreamsProtocol, connection).open_streams() for connection in self.guard.connections)

    def _expired(self, path: str) -> None:
        for observer in self.on_expired:
            observer(path)

    def _protocol_factory(self) -> asyncio.Protocol:  # type: ignore[override]
        # grpclib 0.4.9's own factory (pinned), with our protocol and handler classes in place of its own.
        self.__gc_step__()
        handler = _RefusingHandler(
            self._mapping,
            self._codec,
            self._status_details_codec,
            self.__dispatch__,
            guard=self.guard,
            expired=self._expired,
        )
        self._handlers.add(handler)
        protocol = _ManyStreamsProtocol(handler, self._config, self._h2_config, self.guard)
        return protocol if self._tls is None else _TlsAccepting(protocol, self._tls)
