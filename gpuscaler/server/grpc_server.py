"""A grpclib Server that accepts KEDA's way of using one connection for everything.

KEDA multiplexes every ScaledObject's calls and push streams over ONE HTTP/2 connection per scaler
address. h2 announces MAX_CONCURRENT_STREAMS = 100, so the 101st open StreamIsActive would make every
later call from KEDA wait. grpclib has no setting for it; we raise it the way grpclib itself raises
INITIAL_WINDOW_SIZE, with a SETTINGS update right after the connection preface.

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
import functools
from collections.abc import Callable, Collection
from typing import Any, Literal, cast

from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec, ProtoStatusDetailsCodec, _googleapis_available
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, Stream, _set_nodelay
from grpclib.server import Handler as ConnectionHandler
from grpclib.server import Server
from grpclib.server import Stream as ServerStream
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import UnknownFrameReceived, WindowUpdated
from h2.settings import SettingCodes

from gpuscaler.generated.externalscaler import GetMetricsRequest, GetMetricsResponse, ScaledObjectRef

MAX_CONCURRENT_STREAMS = 16_384
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
# How many streams may close between two of h2's walks over every stream (see _H2Connection), and
# how many finished request tasks may wait between two rebuilds of grpclib's task table (_RefusingHandler).
SWEEP_EVERY_STREAMS = 512
GC_EVERY_REQUESTS = 512
# KEDA's requests, decoded once per distinct bytes (see _ReusingCodec): at most this many, each at most this long.
REUSED_REQUESTS: frozenset[type[Any]] = frozenset({ScaledObjectRef, GetMetricsRequest})
REUSE_ENTRIES = 1024
REUSE_MAX_BYTES = 4096
# Answers a handler gives out again as the same, never-changed message object (ExternalScalerService): encoded once.
REUSED_ANSWERS: frozenset[type[Any]] = frozenset({GetMetricsResponse})


class _H2Connection(H2Connection):
    """h2's connection, without a walk over every stream for each new one.

    h2 counts the open inbound streams for every HEADERS frame that opens a stream, by walking every
    stream it holds (and dropping the closed ones as it goes). With KEDA's push streams on the
    connection that walk is most of a call's cost: 10,000 open streams make every GetMetrics walk
    10,000 streams. The count only decides whether the new stream passes MAX_CONCURRENT_STREAMS,
    and it is never above the number of streams held, so while that number is under the limit the
    answer cannot change: the walk runs only when the limit could be reached, and once every
    SWEEP_EVERY_STREAMS new streams so that closed ones are still dropped.
    """

    _sweep_at = 0  # len(self.streams) at which the next walk runs

    @property
    def open_inbound_streams(self) -> int:
        held = len(self.streams)
        if held < self._sweep_at and held < self.local_settings.max_concurrent_streams:
            return held  # an upper bound, under the limit: the decision is the walk's
        count = super().open_inbound_streams
        self._sweep_at = len(self.streams) + SWEEP_EVERY_STREAMS
        return count


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
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)  # is_closing, get_extra_info, ...


class _WindowWait(asyncio.Event):
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
        stream = super().create_stream(stream_id=stream_id, wrapper=wrapper)
        stream.window_updated = _WindowWait(self.window_waiting)
        return stream


class _ManyStreamsProtocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._grpclib_connection_made(transport)
        h2_connection = self.connection._connection  # grpclib keeps the H2Connection private
        h2_connection.update_settings(
            {
                SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
            }
        )
        # h2 applies an announced limit once the peer acknowledges it; a client that never does is held to it too.
        h2_connection.decoder.max_header_list_size = MAX_HEADER_LIST_BYTES
        self.connection.flush()
        # HTTP/2 peers must ignore frames of unknown types (RFC 9113 section 4.1); grpclib has no processor
        # for h2's UnknownFrameReceived and kills the connection with NotImplementedError instead.
        self.processor.processors[UnknownFrameReceived] = _ignore
        self.processor.processors[WindowUpdated] = self._window_updated

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


def _ignore(event: object) -> None:
    pass


class _RefusingHandler(ConnectionHandler):
    """grpclib's per-connection handler, refusing new requests once the server is closing.

    grpclib also rebuilds its table of request tasks every 10 requests to drop finished ones: with
    10,000 push streams open, that is 1,000 tasks looked at per call. Ours drops each request's task
    from the table as it finishes, so the table holds only calls in progress and what a finished call
    made dies with it (kept for a later rebuild, it was promoted to the oldest generation, where full
    collections walked it: 40 ms each under GetMetrics load, 4 ms without). The rebuild, still needed
    for grpclib's set of cancelled tasks, runs once the table has grown by GC_EVERY_REQUESTS.
    """

    _collect_at = 0  # len(self._tasks) at which the next rebuild runs

    def __gc_step__(self) -> None:
        if len(self._tasks) >= self._collect_at:
            self.__gc_collect__()
            self._collect_at = len(self._tasks) + GC_EVERY_REQUESTS

    def accept(self, stream: Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        if self.closing:
            stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
            release_stream()
            return
        super().accept(stream, headers, release_stream)
        self._tasks[stream].add_done_callback(functools.partial(self._forget, stream))

    def _forget(self, stream: Stream, task: asyncio.Task[None]) -> None:
        # A finished call leaves the table at once: kept until the next rebuild, its task, stream and
        # messages outlived the young collections and were promoted, and full collections then walked them.
        if self._tasks.get(stream) is task:
            del self._tasks[stream]


async def _guard_framing(event: RecvRequest) -> None:
    handler = event.method_func

    async def guarded(stream: ServerStream[Any, Any]) -> None:
        receive = stream.recv_message
        _limit_message_size(stream)

        async def recv_message() -> Any:
            try:
                message = await receive()
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
    """``grpclib.server.Server`` announcing ``MAX_CONCURRENT_STREAMS`` per connection."""

    def __init__(self, handlers: Collection[Any]) -> None:
        # grpclib's defaults when it picks the codec, with ours in place of its ProtoCodec.
        super().__init__(
            handlers,
            codec=_ReusingCodec(),
            status_details_codec=ProtoStatusDetailsCodec() if _googleapis_available() else None,
        )
        self._mapping = _AnswerUnknownMethods(self._mapping)
        listen(self, RecvRequest, _guard_framing)

    def _protocol_factory(self) -> H2Protocol:
        # grpclib 0.4.9's own factory (pinned), with our protocol and handler classes in place of its own.
        self.__gc_step__()
        handler = _RefusingHandler(self._mapping, self._codec, self._status_details_codec, self.__dispatch__)
        self._handlers.add(handler)
        return _ManyStreamsProtocol(handler, self._config, self._h2_config)
