"""One gRPC connection: grpclib's protocol on our h2 classes, and the per-connection half of ConnectionLimits."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any, cast

from grpclib.metadata import decode_timeout
from grpclib.protocol import EventsProcessor, H2Protocol, _set_nodelay
from grpclib.server import Handler as ConnectionHandler
from h2.errors import ErrorCodes
from h2.events import (
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamReset,
    UnknownFrameReceived,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes

from gpuscaler.server.transport.h2 import (
    MAX_HEADER_LIST_BYTES,
    BoundedH2Connection,
    CoalescingTransport,
    WindowWaitingConnection,
    peer_name,
)
from gpuscaler.server.transport.lean_streams import LeanStream
from gpuscaler.server.transport.limits import CALL_RESERVE, PINGS_PER_CALL, ConnectionGuard, TokenBucket

# At most this much of what a peer sent is taken in per turn of the event loop (ManyStreamsProtocol._feed).
FEED_BYTES = 4 * 1024
# After a GOAWAY toward a peer cut off for a flood, how long it has to read it before the socket is dropped.
GOAWAY_GRACE_SECONDS = 1.0
# A reset this soon after its stream opened counts against --max-resets-per-second (see _stream_reset).
RAPID_RESET_SECONDS = 1.0
# A reset this close to its call's deadline, or past it, is the client's deadline, not an attack. The server dates
# a call from when it read the HEADERS; a busy server reads them late, often in one turn with the RST_STREAM the
# client sent at its deadline, so the deadline it computes is late by that lag. A peer that sets deadlines this
# short to reset uncounted abandons work bounded by them, and each call's task ends with its reset.
DEADLINE_SLACK_SECONDS = 0.1


class ManyStreamsProtocol(H2Protocol):
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
        self.preface_at = now  # when its preface completed (the first-request deadline counts from then)
        self.called = False  # True from its first call on: the guard no longer counts it as pending
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
        self.peer = peer_name(transport)
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
        cast(BoundedH2Connection, h2_connection).on_refused = self._refused
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
        if not self.called:
            self.guard.first_call(self)
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
        # Only a reset soon after its stream opened, before the server began to answer it, counts: that is the
        # rapid-reset attack, a stream the server starts work for and the peer drops at once, bypassing the stream
        # limit. KEDA cancelling push streams it held for minutes (a ScaledObject deleted, the operator stopping),
        # or a client closing streams it was answered on, abandons no work: no flood, however many at once.
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
            and not (
                isinstance(stream, LeanStream)
                and stream.deadline_at is not None
                and now >= stream.deadline_at - DEADLINE_SLACK_SECONDS
            )
            and not (isinstance(stream, LeanStream) and stream.answered)
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
            self.preface_at = self.guard.clock()
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
        self.guard.see_off(self)
        self._discarding = True
        cast(CoalescingTransport, self.connection._transport).linger = True
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
            for waiting in list(cast(WindowWaitingConnection, self.connection).window_waiting):
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
        h2_conn = BoundedH2Connection(config=self.h2_config)
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        stream_delta = self.config.http2_stream_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        if stream_delta:
            h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size})
        coalescing = CoalescingTransport(cast(asyncio.Transport, transport))
        self.connection = WindowWaitingConnection(h2_conn, cast(asyncio.Transport, coalescing), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)


def _ignore(event: object) -> None:
    pass
