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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Any

from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol, Stream
from grpclib.server import Handler, Server
from grpclib.server import Stream as ServerStream
from h2.errors import ErrorCodes
from h2.events import UnknownFrameReceived
from h2.settings import SettingCodes

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


class _ManyStreamsProtocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
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


def _ignore(event: object) -> None:
    pass


class _RefusingHandler(Handler):
    """grpclib's per-connection handler, refusing new requests once the server is closing."""

    def accept(self, stream: Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        if self.closing:
            stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
            release_stream()
            return
        super().accept(stream, headers, release_stream)


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


class ManyStreamsServer(Server):
    """``grpclib.server.Server`` announcing ``MAX_CONCURRENT_STREAMS`` per connection."""

    def __init__(self, handlers: Collection[Any]) -> None:
        super().__init__(handlers)
        listen(self, RecvRequest, _guard_framing)

    def _protocol_factory(self) -> H2Protocol:
        # grpclib 0.4.9's own factory (pinned), with our protocol and handler classes in place of its own.
        self.__gc_step__()
        handler = _RefusingHandler(self._mapping, self._codec, self._status_details_codec, self.__dispatch__)
        self._handlers.add(handler)
        return _ManyStreamsProtocol(handler, self._config, self._h2_config)
