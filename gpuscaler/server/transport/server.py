"""A grpclib Server that accepts KEDA's way of using one connection for everything, within bounds.

KEDA multiplexes every ScaledObject's calls and push streams over ONE HTTP/2 connection per scaler
address. h2 announces MAX_CONCURRENT_STREAMS = 100, so the 101st open StreamIsActive would make every
later call from KEDA wait. grpclib has no setting for it; we raise it to ``--max-streams`` the way grpclib
itself raises INITIAL_WINDOW_SIZE, with a SETTINGS update right after the connection preface.

Neither grpclib nor h2 bounds what a peer may hold or send. ``ConnectionLimits`` do (docs/security.md lists
each limit and the upstream report). The package's modules, from the socket up:

- ``tls_accept``: TLS per connection, with the context of the moment (a rotated context revokes sessions);
- ``protocol``: one connection; floods and protocol errors get a GOAWAY before the close, a peer that does not
  read is not read either, and no connection takes more than its turn's budget of the loop at a time;
- ``peer_table``: each peer address's connections and reset budgets, in one table across its connections;
- ``h2``: h2's and grpclib's connection classes at a cost per call that does not grow with open streams;
- ``limits``: the server-wide half of the limits, and the sweep for their timeouts;
- ``calls``: one call, admitted or refused, its request read under bounds; ``codec``: decode and encode once;
- ``lean_streams``: a held push stream's memory.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Collection
from typing import Any, cast

from grpclib.encoding.proto import ProtoStatusDetailsCodec, _googleapis_available
from grpclib.server import Server

from gpuscaler.flags import ConnectionLimits
from gpuscaler.server.transport.calls import (
    AnswerUnknownMethods,
    CallWrapper,
    RefusingHandler,
    guard_framing,
)
from gpuscaler.server.transport.codec import ReusingCodec
from gpuscaler.server.transport.limits import ConnectionGuard
from gpuscaler.server.transport.protocol import ManyStreamsProtocol
from gpuscaler.server.transport.tls_accept import TlsAccepting


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
            codec=ReusingCodec(),
            status_details_codec=ProtoStatusDetailsCodec() if _googleapis_available() else None,
        )
        self._mapping: AnswerUnknownMethods = AnswerUnknownMethods(self._mapping)
        self.guard = ConnectionGuard(limits)
        self._tls = tls
        # Who to tell about a call answered DEADLINE_EXCEEDED before it started (its :path).
        self.on_expired: list[Callable[[str], None]] = []
        self.wrap_calls(guard_framing(self.guard))

    def wrap_calls(self, wrapper: CallWrapper) -> None:
        """Put ``wrapper`` around every call's handler, outside those put before (unknown methods' included).

        In place of a grpclib RecvRequest listener: with one, grpclib builds an event and awaits each listener
        for every call; a wrapper is built once per method.
        """
        self._mapping.wrap(wrapper)

    def close(self) -> None:
        self.guard.close()
        super().close()

    @property
    def handler_tasks(self) -> int:
        """Request tasks alive over every connection, cancelled ones that have not finished included."""
        return sum(cast(RefusingHandler, handler).tasks for handler in self._handlers)

    @property
    def open_streams(self) -> int:
        """Streams grpclib holds over every connection."""
        return sum(cast(ManyStreamsProtocol, connection).open_streams() for connection in self.guard.connections)

    def _expired(self, path: str) -> None:
        for observer in self.on_expired:
            observer(path)

    def _protocol_factory(self) -> asyncio.Protocol:  # type: ignore[override]
        # grpclib 0.4.9's own factory (pinned), with our protocol and handler classes in place of its own.
        self.__gc_step__()
        handler = RefusingHandler(
            self._mapping,
            self._codec,
            self._status_details_codec,
            self.__dispatch__,
            guard=self.guard,
            expired=self._expired,
        )
        self._handlers.add(handler)
        protocol = ManyStreamsProtocol(handler, self._config, self._h2_config, self.guard)
        return protocol if self._tls is None else TlsAccepting(protocol, self._tls)
