"""One gRPC connection: grpclib's protocol on our h2 classes, and the per-connection half of ConnectionLimits."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Callable
from typing import Any, cast

from grpclib.metadata import decode_timeout
from grpclib.protocol import EventsProcessor, H2Protocol
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
    started_connection,
)
from gpuscaler.server.transport.lean_streams import LeanStream
from gpuscaler.server.transport.limits import CALL_RESERVE, PINGS_PER_CALL, ConnectionGuard
from gpuscaler.server.transport.peer_table import TokenBucket

# While frames wait for a connection's next turn, reading it goes on until this much waits unread; past it,
# reading pauses until its turns catch up. Pausing and resuming at every turn cost a tenth of a call's time.
READ_AHEAD_BYTES = 64 * 1024
# After a GOAWAY toward a peer cut off for a flood, how long it has to read it before the socket is dropped.
GOAWAY_GRACE_SECONDS = 1.0
# A reset this soon after its stream opened counts against the peer's reset budgets (see _stream_reset).
RAPID_RESET_SECONDS = 1.0
# A reset once the call has lived this share of its own deadline (grpc-timeout), by the server's clock, is taken
# for the client giving up at that deadline (grpcio and grpc-go reset a call they stop waiting for): it counts
# against the looser --max-deadline-resets-per-second. Earlier, it is a rapid reset like any other, whatever
# deadline the call claims: a peer that claims 100 ms and resets at once abandons work it asked for.
DEADLINE_EXCUSE_SHARE = 0.8


class ManyStreamsProtocol(H2Protocol):
    """grpclib's protocol with our connection classes, and the per-connection half of ConnectionLimits.

    It counts the peer's resets into its address's token buckets in the guard's PeerTable (shared by all that
    address's connections, so reconnecting does not refill them) and its PINGs/SETTINGS into the connection's
    own (past them: GOAWAY ENHANCE_YOUR_CALM), takes in the peer's frames a turn's budget at a time
    (``--turn-calls``, ``--turn-bytes``: the rest waits for its next turn, reordered, not refused), sends GOAWAY
    before closing on a protocol error (grpclib closes without it), stops reading from a peer while our output to
    it is past ``write_buffer_limit_bytes`` (so a peer that never reads cannot make us buffer ACKs without bound),
    and tells the guard's sweep when it last had a stream and whether its preface came.
    """

    _coalescing: CoalescingTransport  # the connection's transport, kept past grpclib's connection_lost

    def __init__(self, handler: ConnectionHandler, config: Any, h2_config: Any, guard: ConnectionGuard) -> None:
        super().__init__(handler, config, h2_config)
        self.guard = guard
        self.peers = guard.peers  # every address's, the guard's table
        now = guard.clock()
        self.accepted_at = now
        self.last_stream_at = now
        self.preface_done = False
        self.preface_at = now  # when its preface completed (the first-request deadline counts from then)
        self.called = False  # True from its first call on: the guard no longer counts it as pending
        self.admitted = False  # True once the guard counts this connection
        self.write_stalled_since: float | None = None
        self.peer = "?"
        self.address = "?"  # the peer's IP: its PeerTable entry (connections, reset budgets) is kept under it
        self._discarding = False
        self._next_turn: asyncio.Handle | None = None  # set while frames wait for this connection's next turn
        self._unread: list[bytes] = []  # what was read while frames waited for the next turn
        self._unread_bytes = 0
        self._paused: set[str] = set()  # why reading is paused: "write" (peer not reading), "turn"
        # When each read came: (the offset its last byte ends at, over all bytes read, and the time), oldest
        # first, until its bytes are taken in. A call's start is when its HEADERS were read, not when a later
        # turn takes them in: the client's deadline runs from then, and a call that waited for its turn and
        # is reset at that deadline has lived it, however soon after its turn the reset is taken in.
        self._reads: collections.deque[tuple[int, float]] = collections.deque()
        self._read_bytes = 0
        self._raw: asyncio.Transport | None = None
        self._pings = TokenBucket(guard.limits.max_pings_per_second, now)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Count this connection against max_connections; False (and the socket dropped) when it is past it."""
        self._raw = cast(asyncio.Transport, transport)
        self.peer = peer_name(transport)
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else self.peer
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
        self._read_bytes += len(data)
        self._reads.append((self._read_bytes, self.guard.clock()))
        if self._next_turn is not None:
            self._unread.append(data)  # after what already waits, in the next turn
            self._unread_bytes += len(data)
            if self._unread_bytes > READ_AHEAD_BYTES:
                self._pause_reading("turn")
            return
        if self._take_turn(data):
            self.guard.defer_turn(self.peer, calls=self.guard.limits.turn_calls, bytes=self.guard.limits.turn_bytes)

    def _take_turn(self, data: bytes) -> bool:
        """This connection's turn of the event loop: at most ``--turn-calls`` calls started and ``--turn-bytes``
        taken in; True when frames are left, which wait for its next turn (reading goes on, to READ_AHEAD_BYTES).

        One read can hold 256 KiB of frames: thousands of calls or resets handled in one callback, and then
        as many handler tasks run in the next, while every other caller and the poll loop wait. A connection
        that sends more than its turn's budget is served over several turns, after every other connection
        has had its own in each: its flood costs its own calls latency, not everyone's. Nothing is refused,
        only reordered: KEDA's thousands of calls on one connection take as many turns as they need.
        This is the one place a peer's bytes are taken in and the budget kept: a faster path for some
        calls must take its frames from ``receive_turn`` too, not around it.
        """
        h2_connection = cast(BoundedH2Connection, self.connection._connection)
        # The same budget for every connection, busy or not: a larger turn for a connection with the loop "to itself"
        # let a flood cost a caller beside it several times its latency (each turn's handlers run before that
        # caller's steps), and in a deployment (KEDA's two components, a gateway) no connection is alone for
        # long (docs/security.md, "Fair turns").
        limits = self.guard.limits
        try:
            events, more = h2_connection.receive_turn(data, limits.turn_calls, limits.turn_bytes)
        except ProtocolError as error:
            # h2 has queued a GOAWAY with the error's code; grpclib would close without sending it.
            self.guard.act("protocol_error", self.peer, error=str(error)[:200])
            self.connection.flush()
            self._close_soon()
            return False
        self.connection.flush()
        for event in events:
            self.processor.process(event)
        h2_connection.call_offsets.clear()  # each call's was claimed as its RequestReceived was processed
        taken, reads = h2_connection.taken(), self._reads
        while reads and reads[0][0] <= taken:
            reads.popleft()
        if not self.connection.is_closing():  # an event may have cut the peer off
            self.connection.flush()
        if not more or self._discarding:
            return False
        if h2_connection.incoming_buffer.held() > READ_AHEAD_BYTES:
            self._pause_reading("turn")
        self._next_turn = asyncio.get_running_loop().call_soon(self._next_turn_due)
        self._coalescing.holding = True  # more answers are coming: hold them to go out together
        return True

    def _next_turn_due(self) -> None:
        self._next_turn = None
        if self._discarding:
            return
        unread = b"".join(self._unread)
        self._unread.clear()
        self._unread_bytes = 0
        try:
            more = self._take_turn(unread)
        except Exception as error:  # noqa: BLE001 - what asyncio does when data_received raises
            # A deferred turn runs from call_soon, not from the transport: an error here would reach the loop's
            # handler alone, leaving the connection open with the rest of its events dropped and, if reading was
            # paused for read-ahead, never resumed. So, as the transport does for data_received: log it, drop it.
            asyncio.get_running_loop().call_exception_handler(
                {
                    "message": "Fatal error: protocol.data_received() call failed.",
                    "exception": error,
                    "transport": self._raw,
                    "protocol": self,
                }
            )
            self.abort()
            return
        if not more:
            self._coalescing.holding = False
            if not self._discarding:
                self._resume_reading("turn")

    def _request_received(self, accept: Callable[[RequestReceived], None], event: RequestReceived) -> None:
        self.last_stream_at = self.guard.clock()
        if not self.called:
            self.guard.first_call(self)
        self._pings.give(PINGS_PER_CALL)
        accept(event)
        stream = self.processor.streams.get(event.stream_id)
        offset = cast(BoundedH2Connection, self.connection._connection).call_offsets.get(event.stream_id)
        if isinstance(stream, LeanStream) and offset is not None:
            stream.created = self._read_at(offset)
        if isinstance(stream, LeanStream) and stream.created is not None:
            for name, value in cast(list[tuple[str, str]], event.headers):
                if name == "grpc-timeout":
                    with contextlib.suppress(ValueError):  # grpclib answers a bad one itself
                        stream.deadline_at = stream.created + decode_timeout(value)
                    break

    def _read_at(self, offset: int) -> float:
        """When the byte at ``offset`` (over all bytes read) was read; now if its read is no longer known."""
        for end, at in self._reads:
            if end > offset:
                return at
        return self.guard.clock()

    def _stream_reset(self, reset: Callable[[StreamReset], None], event: StreamReset) -> None:
        # Only a reset soon after its stream opened, before the server began to answer it, counts: that is the
        # rapid-reset attack, a stream the server starts work for and the peer drops at once, bypassing the stream
        # limit. KEDA cancelling push streams it held for minutes (a ScaledObject deleted, the operator stopping),
        # or a client closing streams it was answered on, abandons no work: no flood, however many at once.
        # The budgets are the peer address's, not the connection's: reconnecting does not refill them.
        stream = self.processor.streams.get(event.stream_id)
        now = self.guard.clock()
        reset(event)
        if (
            not event.remote_reset
            or stream is None
            or stream.created is None
            or now - stream.created >= RAPID_RESET_SECONDS
            or (isinstance(stream, LeanStream) and stream.answered)
        ):
            return
        limits = self.guard.limits
        if isinstance(stream, LeanStream) and stream.deadline_at is not None:
            lived, timeout = now - stream.created, stream.deadline_at - stream.created
            if lived >= DEADLINE_EXCUSE_SHARE * timeout:
                # The client's own deadline (grpc-go and grpcio cancel a call they stop waiting for): the
                # server would end that call about now anyway. Still counted, in a looser budget.
                if not self.peers.take_deadline(self.address, now):
                    self._calm(
                        "deadline_reset_flood",
                        f"more than {limits.max_deadline_resets_per_second} resets at their deadline a second",
                    )
                return
        if not self.peers.take_rapid(self.address, now):
            self._calm("reset_flood", f"more than {limits.max_resets_per_second} rapid resets a second")

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

    def go_away_idle(self, reason: str = "idle") -> None:
        """GOAWAY NO_ERROR (``reason`` as its debug data) and close: gRPC clients open a new connection when they
        next need one."""
        self._go_away(ErrorCodes.NO_ERROR, reason)
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
        self._coalescing.linger = True
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
        self._discarding = True  # a turn still scheduled must not feed a closed connection
        self._unread.clear()
        self._reads.clear()
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
        h2_conn = started_connection(BoundedH2Connection, transport, self.h2_config, self.config)
        self._coalescing = CoalescingTransport(cast(asyncio.Transport, transport))
        self.connection = WindowWaitingConnection(
            h2_conn, cast(asyncio.Transport, self._coalescing), config=self.config
        )
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)


def _ignore(event: object) -> None:
    pass
