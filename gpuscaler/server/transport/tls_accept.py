"""TLS per connection, with the context current at its handshake, so that a rotated CA revokes old sessions."""

from __future__ import annotations

import asyncio
import math
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import cast

from gpuscaler.server.transport.protocol import ManyStreamsProtocol


class TlsAccepting(asyncio.Protocol):
    """A new TCP connection's first protocol: TLS with the context of the moment its ClientHello comes, then HTTP/2.

    asyncio's server TLS is one context for the listener's life, and session tickets and the session cache
    belong to it: a client resuming a session made before a CA rotation would get in without its certificate
    being checked again. Here each handshake uses the context ``contexts()`` gives at that moment, so a
    rotation brings a fresh context, whose tickets and cache know no earlier session (docs/tls.md).

    Nothing of TLS exists until the client's first bytes: a connection that never sends a ClientHello costs
    what a plaintext one does, until the guard's handshake timeout closes it.
    """

    def __init__(self, inner: ManyStreamsProtocol, contexts: Callable[[], ssl.SSLContext]) -> None:
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
        tls = SmallBufferTlsProtocol(
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


class SmallBufferTlsProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol with a 16 KiB read buffer instead of 256 KiB: one TLS record, read at a time.

    Its buffer is allocated for the connection's life, so with asyncio's size 200 TLS connections took 60 MiB.
    """

    max_size = 16 * 1024
