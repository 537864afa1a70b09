"""A grpclib Server that accepts KEDA's way of using one connection for everything.

KEDA multiplexes every ScaledObject's calls and push streams over ONE HTTP/2 connection per scaler
address. h2 announces MAX_CONCURRENT_STREAMS = 100, so the 101st open StreamIsActive would make every
later call from KEDA wait. grpclib has no setting for it; we raise it the way grpclib itself raises
INITIAL_WINDOW_SIZE, with a SETTINGS update right after the connection preface.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from grpclib.protocol import H2Protocol
from grpclib.server import Handler, Server
from h2.settings import SettingCodes

MAX_CONCURRENT_STREAMS = 16_384


class _ManyStreamsProtocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        h2_connection = self.connection._connection  # grpclib keeps the H2Connection private
        h2_connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self.connection.flush()


class ManyStreamsServer(Server):
    """``grpclib.server.Server`` announcing ``MAX_CONCURRENT_STREAMS`` per connection."""

    def __init__(self, handlers: Collection[Any]) -> None:
        super().__init__(handlers)

    def _protocol_factory(self) -> H2Protocol:
        # grpclib 0.4.9's own factory (pinned), with our protocol class in place of H2Protocol.
        self.__gc_step__()
        handler = Handler(self._mapping, self._codec, self._status_details_codec, self.__dispatch__)
        self._handlers.add(handler)
        return _ManyStreamsProtocol(handler, self._config, self._h2_config)
