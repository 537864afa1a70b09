"""h2's connection and grpclib's, changed so that a call costs the same with 10,000 push streams open as with one.

With thousands of streams open on KEDA's one connection, h2 walks every stream for each new one, grpclib wakes
every stream per connection-level WINDOW_UPDATE, and every frame is its own socket write. These classes keep the
same behaviour at a cost per call that does not grow with open streams, and send one write per turn of the event
loop (bench/results/compare*.json have the figures). They also bound what h2 would hold of a header block, and
take in a peer's frames a turn's budget at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

from grpclib.config import Configuration
from grpclib.protocol import Connection, Stream, _set_nodelay
from h2.config import H2Configuration
from h2.connection import H2Connection, _decode_headers
from h2.errors import ErrorCodes
from h2.events import Event
from h2.exceptions import ProtocolError, StreamClosedError, StreamIDTooLowError, TooManyStreamsError
from h2.frame_buffer import FrameBuffer
from h2.settings import SettingCodes
from h2.stream import StreamClosedBy
from hyperframe.exceptions import InvalidPaddingError
from hyperframe.frame import Frame, HeadersFrame, RstStreamFrame

from gpuscaler.server.transport.lean_streams import LeanEvent, LeanStream

# KEDA sends a handful of short headers, and h2 decodes the whole block (its default allows 64 KiB, ~25 ms of
# HPACK) in one callback. gRPC's own servers default to 8 KiB of metadata too. A larger block closes the connection.
MAX_HEADER_LIST_BYTES = 8 * 1024
# HPACK can shrink a header list, so the encoded block may be a little larger than the list it decodes to.
MAX_HEADER_BLOCK_BYTES = 2 * MAX_HEADER_LIST_BYTES
# How many streams may close between two of h2's walks over every stream (see BoundedH2Connection).
SWEEP_EVERY_STREAMS = 512
# At most this many frames of one connection are taken in per turn of the event loop, whatever their size:
# the smallest (a WINDOW_UPDATE, 13 bytes) still cost h2 and grpclib a few microseconds each.
TURN_FRAMES = 64
HEADERS_TYPE = HeadersFrame.type
# While a connection's frames wait for its next turn, its answers are held over at most this many turns, and
# this many bytes, and sent as one write: a write to a socket is a system call, on loopback with the reader's
# TCP receive work done in it, and with 2 calls a turn one write per turn was the turn budget's largest cost.
HOLD_TURNS = 8
HOLD_BYTES = 16 * 1024


def peer_name(transport: asyncio.BaseTransport) -> str:
    """The peer's ``host:port`` as logs and the limits' counts name it."""
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


_C = TypeVar("_C", bound=H2Connection)


def started_connection(
    kind: type[_C], transport: asyncio.BaseTransport, h2_config: H2Configuration, config: Configuration
) -> _C:
    """grpclib 0.4.9's ``H2Protocol.connection_made`` (pinned) up to its Connection, with ``kind`` in place of h2's
    connection: TCP_NODELAY, the preface, and the windows ``config`` asks for. Both sides' protocols start here."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        _set_nodelay(sock)
    h2_conn = kind(config=h2_config)
    h2_conn.initiate_connection()
    initial = h2_conn.local_settings.initial_window_size
    conn_delta = config.http2_connection_window_size - initial
    stream_delta = config.http2_stream_window_size - initial
    if conn_delta:
        h2_conn.increment_flow_control_window(conn_delta)
    if stream_delta:
        h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: config.http2_stream_window_size})
    return h2_conn


class QuietH2Connection(H2Connection):
    """h2's connection, less the repr of every frame it takes in, built for a trace log that is off."""

    def _receive_frame(self, frame: Frame) -> list[Event]:
        # h2 4.4.1's (pinned), without its first line: ``logger.trace("Received frame: %s", repr(frame))`` builds
        # the frame's repr for a trace log that is off (h2's logger is a no-op unless one is configured), on every
        # frame received: ~3% of a unary call's CPU, and of the gateway's per snapshot on its agents' connections.
        events: list[Event]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as e:
            # Closed by RST_STREAM: a stream error, answered with RST_STREAM; otherwise a connection error.
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = e.error_code
                self._prepare_for_sending([f])
                events = e._events
            else:
                raise
        except StreamIDTooLowError as e:
            # A closed (and cleaned up) stream's id, or one below a newer stream's: how it closed decides.
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([f])
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise StreamClosedError(e.stream_id) from e
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events


class BoundedH2Connection(QuietH2Connection):
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
        self.incoming_buffer: BoundedFrameBuffer = BoundedFrameBuffer(server=not self.config.client_side)
        self.received = 0  # bytes given to receive_turn, in all
        # Where each call taken in and not yet claimed began, in those bytes: its HEADERS may be taken in turns
        # after it was read, and the protocol stamps the call's start from when that byte was read.
        self.call_offsets: dict[int, int] = {}

    def taken(self) -> int:
        """Bytes given to receive_turn that it has taken in as frames (the preface among them)."""
        return self.received - self.incoming_buffer.held()

    @property
    def open_inbound_streams(self) -> int:
        held = len(self.streams)
        if held < self._sweep_at and held < self.local_settings.max_concurrent_streams:
            return held  # an upper bound, under the limit: the decision is the walk's
        count = super().open_inbound_streams
        self._sweep_at = len(self.streams) + SWEEP_EVERY_STREAMS
        return count

    def receive_turn(self, data: bytes, calls: int, size: int) -> tuple[list[Event], bool]:
        """h2's ``receive_data``, stopping before a HEADERS past ``calls`` of them, or after TURN_FRAMES frames or
        ``size`` bytes of frames.

        The events of the frames taken in, and whether whole frames are left in the buffer for another turn
        (``receive_turn(b"", ...)`` takes them). A frame is never split: one larger than ``size`` is taken
        whole. A call's frames after its HEADERS (its message, a RST_STREAM) come in the same turn when they
        can, so a call and its reset are judged together.
        """
        events: list[Event] = []
        buffer = self.incoming_buffer
        self.received += len(data)
        buffer.add_data(data)
        buffer.max_frame_size = self.max_inbound_frame_size
        held = buffer.held()
        headers = frames = 0
        try:
            while True:  # h2's own loop over the buffer, counting as it goes
                if (
                    (headers >= calls and buffer.headers_next())
                    or frames >= TURN_FRAMES
                    or held - buffer.held() >= size
                ):
                    return events, buffer.has_frame()
                start = self.received - buffer.held()
                frame = next(buffer, None)
                if frame is None:
                    return events, False
                if isinstance(frame, HeadersFrame):
                    headers += 1
                    self.call_offsets[frame.stream_id] = start
                events.extend(self._receive_frame(frame))
                frames += 1
        except InvalidPaddingError as error:
            self._terminate_connection(ErrorCodes.PROTOCOL_ERROR)
            raise ProtocolError("Received frame with invalid padding.") from error
        except ProtocolError as error:
            self._terminate_connection(error.error_code)  # h2 queues its GOAWAY, as receive_data does
            raise

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


class BoundedFrameBuffer(FrameBuffer):
    """h2's frame buffer, refusing a header block before it grows past MAX_HEADER_BLOCK_BYTES undecoded.

    h2 joins a HEADERS frame and its CONTINUATIONs before decoding them and allows 64 frames of up to 16 KiB:
    about 1 MiB a connection held for a block MAX_HEADER_LIST_BYTES would refuse anyway (200 connections took
    the agent past its memory limit). A block past the bound is the peer's protocol error.
    """

    def held(self) -> int:
        """Bytes received and not yet taken in as frames."""
        return len(self._data)

    def has_frame(self) -> bool:
        """Whether a whole frame waits in the buffer."""
        return len(self._data) >= 9 and len(self._data) >= 9 + int.from_bytes(self._data[:3], "big")

    def headers_next(self) -> bool:
        """Whether the next frame is a HEADERS (a call's start, on a server) that has come whole."""
        return self.has_frame() and self._data[3] == HEADERS_TYPE

    def _update_header_buffer(self, f: Any) -> Any:
        frame = super()._update_header_buffer(f)
        if self._headers_buffer and sum(len(part.data) for part in self._headers_buffer) > MAX_HEADER_BLOCK_BYTES:
            raise ProtocolError(f"a header block of more than {MAX_HEADER_BLOCK_BYTES} bytes")
        return frame


class CoalescingTransport:
    """The connection's transport, sending everything written in one turn of the event loop as one write.

    grpclib writes to the socket for each frame it sends: a unary answer is three writes (headers,
    data, trailers), each a send() system call and, with TCP_NODELAY, a packet. Those writes were
    the largest item in the agent's profile under GetMetrics load. Here they are joined and sent at
    the end of the turn, so a call costs one write, and concurrent calls answered in the same turn
    share one. The order of the bytes does not change, and nothing waits longer than the turn, except while
    the protocol says ``holding``: its peer's frames wait for the connection's next turns, so more answers are
    coming, and they are held over up to HOLD_TURNS turns (HOLD_BYTES) to go out in one write.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._held_turns = 0
        self._loop = asyncio.get_running_loop()
        self.holding = False  # set by the protocol while the peer's frames wait for the connection's next turn
        # Set when the server cuts the peer off: close() then only ends our side, so the GOAWAY is read
        # before the socket goes (closing with the peer's data unread would reset the connection and lose it).
        self.linger = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)
        self._pending_bytes += len(data)

    def _flush(self) -> None:
        if not self._pending:
            return
        if self.holding and self._held_turns < HOLD_TURNS and self._pending_bytes < HOLD_BYTES:
            self._held_turns += 1
            self._loop.call_soon(self._flush)
            return
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = self._held_turns = 0
        self._transport.write(data)

    def close(self) -> None:
        self.holding = False
        self._flush()  # what was written before close() still goes out first, as it would have
        if not self.linger:
            self._transport.close()
        elif self._transport.can_write_eof():
            self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)  # is_closing, get_extra_info, ...


class WindowWait(LeanEvent):
    """A stream's ``window_updated``, known to its connection while the stream waits on it."""

    def __init__(self, waiting: set[WindowWait]) -> None:
        super().__init__()
        self._waiting = waiting

    async def wait(self) -> Literal[True]:
        self._waiting.add(self)
        try:
            return await super().wait()
        finally:
            self._waiting.discard(self)


class WindowWaitingConnection(Connection):
    """grpclib's connection, keeping the streams that wait for flow-control window.

    On a WINDOW_UPDATE for the whole connection grpclib wakes every stream it holds; with 10,000
    push streams that is 10,000 ``Event.set()`` calls, and a grpc client sends one with most calls.
    Only a stream blocked in ``send_data`` waits on that event (it clears it just before), so
    waking just the waiting ones is the same.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_waiting: set[WindowWait] = set()

    def create_stream(self, *, stream_id: int | None = None, wrapper: Any = None) -> Stream:
        window = WindowWait(self.window_waiting)
        return LeanStream(self, self._connection, self._transport, window, stream_id=stream_id, wrapper=wrapper)
