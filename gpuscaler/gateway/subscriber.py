"""One task per agent: hold its WatchSnapshots stream open and feed the cluster view, reconnecting for ever.

Reconnects wait 0.1 s, doubling to at most 5 s, with jitter so that a restarted gateway does not dial
every agent in lockstep; any snapshot received resets the wait. This is a dozen lines by hand, on
purpose: retry libraries (tenacity, stamina, backoff) retry a call until it succeeds, while this stream
never "succeeds", it runs until it breaks, and the wait must reset whenever it delivered data.
A stream that stays silent for one to two times the agent's staleness bound is dropped and
dialled again, so a half-open connection does not hold a node out of the view.
"""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
from dataclasses import dataclass
from typing import cast

import structlog
from grpclib.client import Channel, Handler
from grpclib.config import Configuration
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.protocol import Connection, EventsProcessor, H2Protocol

from gpuscaler.flags import Address
from gpuscaler.gateway.decoding import MalformedSnapshot, SnapshotDecoder, watch_request
from gpuscaler.gateway.discovery import lookup_failure
from gpuscaler.gateway.view import AgentRefused, ClusterView
from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2
from gpuscaler.model.staleness import snapshot_stale_after
from gpuscaler.server.transport.h2 import QuietH2Connection, started_connection

log = structlog.get_logger(__name__)

WATCH_METHOD = "/gpuscaler.v1.Agent/WatchSnapshots"
INITIAL_BACKOFF_SECONDS = 0.1
MAX_BACKOFF_SECONDS = 5.0
FIRST_MESSAGE_TIMEOUT_SECONDS = 10.0


class _QuietProtocol(H2Protocol):
    """grpclib's client protocol over ``QuietH2Connection``: no frame's repr built, thousands of frames a second."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # grpclib 0.4.9's H2Protocol.connection_made (pinned), with our H2Connection in place of h2's.
        h2_conn = started_connection(QuietH2Connection, transport, self.h2_config, self.config)
        self.connection = Connection(h2_conn, cast(asyncio.Transport, transport), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)


class _QuietChannel(Channel):
    """grpclib's channel, its connections ``_QuietProtocol``'s."""

    def _protocol_factory(self) -> H2Protocol:
        return _QuietProtocol(Handler(), self._config, self._h2_config)


@dataclass(frozen=True, slots=True)
class AgentTLS:
    """How the gateway dials agents that serve TLS: a client context, and the name their certificate has."""

    context: ssl.SSLContext
    server_name: str | None = None


class AgentSubscriber:
    """Streams one agent's snapshots into ``view`` until cancelled."""

    def __init__(self, endpoint: Address, view: ClusterView, *, tls: AgentTLS | None = None) -> None:
        self.endpoint = endpoint
        self.agent = str(endpoint)
        self._view = view
        self._decoder = SnapshotDecoder()
        self._tls = tls
        self.node: str | None = None
        self.connected = False
        self.received = 0
        self.connects = 0
        self.failures = 0

    async def run(self) -> None:
        backoff = INITIAL_BACKOFF_SECONDS
        while True:
            before = self.received
            try:
                await self._stream_once()
                outcome, detail = "ended", "the agent ended its stream (it is stopping)"
            except AgentRefused as refusal:
                outcome, detail = "refused", str(refusal)
            except (OSError, GRPCError, StreamTerminatedError, ProtocolError, TimeoutError, MalformedSnapshot) as error:
                outcome, detail = "failed", _describe(error, self.endpoint.host)
            finally:
                self.connected = False
            self._view.trouble(self.agent, detail)
            progressed = self.received > before
            if progressed:
                backoff = INITIAL_BACKOFF_SECONDS
            # One warning per outage, not one per retry.
            quiet = outcome != "ended" and not progressed and self.failures > 0
            self.failures = 0 if progressed else self.failures + 1
            (log.debug if quiet else log.info if outcome != "failed" else log.warning)(
                "agent_stream_" + outcome, agent=str(self.endpoint), node=self.node, detail=detail, retry_in=backoff
            )
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))  # noqa: S311 - jitter, not a secret
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    async def _stream_once(self) -> None:
        config = Configuration(ssl_target_name_override=self._tls.server_name) if self._tls else None
        channel = _QuietChannel(
            self.endpoint.host,
            self.endpoint.port,
            ssl=self._tls.context if self._tls else None,
            config=config,
        )
        self.connects += 1
        try:
            while True:
                # The windows the view's queries use: when it needs another, it sets `changed`, and the stream
                # is reopened on the same connection with the new list.
                changed, windows = self._view.windows_changed, self._view.windows
                request = watch_request(windows)
                async with channel.request(
                    WATCH_METHOD, Cardinality.UNARY_STREAM, agent_pb2.WatchSnapshotsRequest, agent_pb2.Snapshot
                ) as stream:
                    await stream.send_message(request, end=True)
                    loop = asyncio.get_running_loop()
                    # One deadline per stream: a stream silent for it is redialled. It is moved on only once
                    # half of it has passed (a timer per message would be thousands a second on a big
                    # cluster), so a silent stream is redialled after one to two staleness bounds.
                    async with asyncio.timeout(FIRST_MESSAGE_TIMEOUT_SECONDS) as silence:
                        while not changed.is_set():
                            message = await stream.recv_message()
                            if message is None:
                                return
                            self._receive(message)
                            bound = snapshot_stale_after(message.poll_interval_seconds or 1.0)
                            now = loop.time()
                            if (silence.when() or now) - now < bound:
                                silence.reschedule(now + 2 * bound)
                    await stream.cancel()
        finally:
            channel.close()

    def _receive(self, message: agent_pb2.Snapshot) -> None:
        snapshot = self._decoder.decode(message, monotonic=asyncio.get_running_loop().time())
        if not self.connected:
            self.connected = True
            log.info(
                "agent_stream_opened",
                agent=str(self.endpoint),
                node=snapshot.node,
                gpus=len(snapshot.samples),
                attribution=snapshot.attribution.state.value,
            )
        if self.node is not None and snapshot.node != self.node:
            log.warning("agent_node_changed", agent=str(self.endpoint), before=self.node, after=snapshot.node)
        self._view.update(self.agent, snapshot, poll_interval_seconds=message.poll_interval_seconds or 1.0)
        self.node = snapshot.node
        self.received += 1


def _describe(error: BaseException, host: str) -> str:
    """Why a stream to an agent at ``host`` ended, in words: the reason every answer it blocks names."""
    if isinstance(error, GRPCError):
        return f"{error.status.name}: {error.message}"
    if isinstance(error, TimeoutError):
        return "no snapshot within the expected time; the connection may be half-open"
    if isinstance(error, socket.gaierror):
        return lookup_failure(host, error)
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, OSError) and error.strerror:  # "connection reset by peer", "no route to host"
        return error.strerror[:1].lower() + error.strerror[1:]
    return repr(error)
