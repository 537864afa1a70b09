"""ConnectionLimits, enforced: token buckets, the guard's sweep, and each limit against a raw HTTP/2 peer.

The in-process tests drive an agent over a socket with h2 as the client, at small limits, so each shows one
limit acting (the connection cut or the stream refused), counted, and the good behaviour beside it intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from typing import cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import structlog
from grpclib.client import Channel
from h2.events import Event

from gpuscaler.agent.process import Agent
from gpuscaler.flags import DEFAULT_LIMITS, ConnectionLimits
from gpuscaler.generated.externalscaler import ExternalScalerStub, ScaledObjectRef
from gpuscaler.server.overload import LOG_EVERY_SECONDS
from gpuscaler.server.transport import calls, protocol
from gpuscaler.server.transport.h2 import BoundedH2Connection
from gpuscaler.server.transport.limits import CALL_RESERVE, PENDING_GRACE_SECONDS, ConnectionGuard
from gpuscaler.server.transport.peer_table import BURST_SECONDS, TokenBucket
from tests.conftest import StartAgent
from tests.server.transport.test_many_streams import request_headers
from tests.waiting import until

IS_ACTIVE = "/externalscaler.ExternalScaler/IsActive"
STREAM_IS_ACTIVE = "/externalscaler.ExternalScaler/StreamIsActive"
EMPTY_REF = struct.pack(">?I", False, 0)  # an empty ScaledObjectRef as a gRPC frame


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    """A full bucket gives its burst, then its rate; given tokens count up to the burst."""
    bucket = TokenBucket(10, now=0.0)
    assert all(bucket.take(0.0) for _ in range(int(10 * BURST_SECONDS)))
    assert not bucket.take(0.0)
    assert bucket.take(0.1)  # 0.1 s at 10 a second: one more
    assert not bucket.take(0.1)
    bucket.give(2)
    assert bucket.take(0.1)
    assert bucket.take(0.1)
    assert not bucket.take(0.1)


@dataclasses.dataclass(eq=False)
class _Connection:
    """What the sweep reads from a connection, and what it did to it."""

    accepted_at: float = 0.0
    preface_done: bool = True
    preface_at: float = 0.0
    called: bool = True
    last_stream_at: float = 0.0
    write_stalled_since: float | None = None
    peer: str = "127.0.0.1:1"
    streams: int = 0
    fate: str = "open"

    @property
    def address(self) -> str:
        return self.peer.rpartition(":")[0]

    def open_streams(self) -> int:
        return self.streams

    def go_away_idle(self, reason: str = "idle") -> None:
        self.fate = "idle"

    def abort(self) -> None:
        self.fate = "aborted"


async def test_the_sweep_closes_each_kind_of_stuck_connection_and_only_those() -> None:
    """No preface in time, idle, or not reading past the write timeout: closed; the rest are left alone."""
    now = 100.0
    limits = ConnectionLimits(handshake_timeout_seconds=1, idle_timeout_seconds=5, write_timeout_seconds=3)
    guard = ConnectionGuard(limits, clock=lambda: now)
    no_preface = _Connection(accepted_at=98.5, preface_done=False)
    young = _Connection(accepted_at=99.5, preface_done=False)
    idle = _Connection(last_stream_at=94.0)
    streaming = _Connection(last_stream_at=0.0, streams=1)  # a push stream open for ever is not idle
    stalled = _Connection(last_stream_at=99.0, streams=1, write_stalled_since=96.0)
    draining = _Connection(last_stream_at=99.0, streams=1, write_stalled_since=98.0)
    connections = [no_preface, young, idle, streaming, stalled, draining]
    try:
        for connection in connections:
            assert guard.admit_connection(connection)
        guard.sweep()
    finally:
        guard.close()
    assert [c.fate for c in connections] == ["aborted", "open", "idle", "open", "aborted", "open"]
    assert guard.connections == {young, streaming, draining}
    assert guard.limited == {"handshake_timeout": 1, "idle_timeout": 1, "write_stalled": 1}


async def test_the_sweep_gives_a_connection_without_a_call_the_first_request_timeout() -> None:
    """A preface and no call: GOAWAY after --first-request-timeout from the preface; one that made a call, or
    is in its first call, waits for the idle timeout."""
    now = 100.0
    limits = dataclasses.replace(DEFAULT_LIMITS, first_request_timeout_seconds=2, idle_timeout_seconds=300)
    guard = ConnectionGuard(limits, clock=lambda: now)
    late = _Connection(preface_at=97.5, last_stream_at=97.0, called=False)
    young = _Connection(preface_at=99.0, last_stream_at=99.0, called=False)
    served = _Connection(preface_at=10.0, last_stream_at=90.0)
    calling = _Connection(preface_at=90.0, last_stream_at=90.0, called=False, streams=1)
    connections = [late, young, served, calling]
    try:
        for connection in connections:
            assert guard.admit_connection(connection)
        guard.sweep()
    finally:
        guard.close()
    assert [c.fate for c in connections] == ["idle", "open", "open", "open"]
    assert guard.limited == {"first_request_timeout": 1}


async def test_connections_yet_to_make_a_call_hold_at_most_their_share_the_oldest_giving_way() -> None:
    """Past --max-pending-connections, each newcomer closes the oldest pending connection (aborted before its
    preface, GOAWAY after it); connections that made calls are never displaced, and a first call ends pending."""
    limits = dataclasses.replace(DEFAULT_LIMITS, max_connections=5, max_pending_connections=2)
    guard = ConnectionGuard(limits)
    served = _Connection(peer="10.0.0.1:1")
    first = _Connection(peer="10.0.0.2:1", called=False, preface_done=False)
    second = _Connection(peer="10.0.0.3:1", called=False)
    third = _Connection(peer="10.0.0.4:1", called=False)
    fourth = _Connection(peer="10.0.0.5:1", called=False)
    try:
        for connection in (served, first, second, third):
            assert guard.admit_connection(connection)
        assert (first.fate, second.fate) == ("aborted", "open")
        guard.first_call(third)
        assert list(guard.pending) == [second]
        assert guard.admit_connection(fourth)
        assert second.fate == "open"  # one pending place was free again
        assert guard.admit_connection(_Connection(peer="10.0.0.6:1", called=False))
        assert second.fate == "idle"
    finally:
        guard.close()
    assert served.fate == third.fate == "open"
    assert guard.limited == {"displaced": 2}
    assert len(guard.connections) == 4


async def test_the_address_holding_most_pending_connections_gives_way_first() -> None:
    """A newcomer displaces the oldest pending connection of the address with the most of them, not the oldest of
    all: strangers reconnecting from one place displace each other before a lone caller from another."""
    limits = dataclasses.replace(DEFAULT_LIMITS, max_pending_connections=3)
    guard = ConnectionGuard(limits)
    lone = _Connection(peer="10.0.0.1:1", called=False)
    first, second = _Connection(peer="10.0.0.9:1", called=False), _Connection(peer="10.0.0.9:2", called=False)
    try:
        for connection in (lone, first, second):
            assert guard.admit_connection(connection)
        assert guard.admit_connection(_Connection(peer="10.0.0.2:1", called=False))
    finally:
        guard.close()
    assert (lone.fate, first.fate, second.fate) == ("open", "idle", "open")
    assert guard.peers.pending() == {"10.0.0.1": 1, "10.0.0.9": 1, "10.0.0.2": 1}


async def test_an_address_with_a_pending_connection_waits_for_it_before_another() -> None:
    """With the pending share full, a newcomer from an address that holds a pending connection younger than
    PENDING_GRACE_SECONDS is refused (max_pending_connections); once that one is older, it gives way to the
    newcomer: the address's own, not a lone caller's older one."""
    now = 100.0
    guard = ConnectionGuard(dataclasses.replace(DEFAULT_LIMITS, max_pending_connections=2), clock=lambda: now)
    lone = _Connection(accepted_at=99.0, peer="10.0.0.1:1", called=False)
    stranger = _Connection(accepted_at=99.5, peer="10.0.0.9:1", called=False)
    try:
        assert guard.admit_connection(lone)
        assert guard.admit_connection(stranger)
        assert not guard.admit_connection(_Connection(accepted_at=now, peer="10.0.0.9:2", called=False))
        now = 99.5 + PENDING_GRACE_SECONDS
        assert guard.admit_connection(_Connection(accepted_at=now, peer="10.0.0.9:3", called=False))
    finally:
        guard.close()
    assert (lone.fate, stranger.fate) == ("open", "idle")
    assert guard.limited == {"max_pending_connections": 1, "displaced": 1}


async def test_connections_and_streams_are_admitted_up_to_their_limits() -> None:
    """Admission counts up to each limit, and a release makes room again."""
    guard = ConnectionGuard(dataclasses.replace(DEFAULT_LIMITS, max_connections=2, max_streams=3))
    first, second, third = _Connection(), _Connection(), _Connection()
    try:
        assert guard.admit_connection(first)
        assert guard.admit_connection(second)
        assert not guard.admit_connection(third)
        guard.release_connection(first)
        assert guard.admit_connection(third)
    finally:
        guard.close()
    assert [guard.admit_stream(streaming=True) for _ in range(4)] == [True, True, True, False]
    # Calls have CALL_RESERVE places of their own beyond the push streams' limit.
    assert all(guard.admit_stream(streaming=False) for _ in range(CALL_RESERVE))
    assert not guard.admit_stream(streaming=False)
    guard.release_stream(streaming=False)
    assert not guard.admit_stream(streaming=True)  # the push streams' own limit
    assert guard.admit_stream(streaming=False)
    guard.release_stream(streaming=True)
    guard.release_stream(streaming=False)
    assert guard.admit_stream(streaming=True)
    assert guard.push_streams == 3
    assert guard.limited == {"max_connections": 1}  # the caller of admit_stream counts its own refusal


def test_an_acting_limit_logs_once_per_interval_and_counts_every_time() -> None:
    """A thousand actions are a thousand counts and one log line, and the next line says how many it covers."""
    now = 0.0
    guard = ConnectionGuard(DEFAULT_LIMITS, clock=lambda: now)
    seen: list[str] = []
    guard.on_limited.append(seen.append)
    with structlog.testing.capture_logs() as logged:
        for _ in range(1_000):
            guard.act("reset_flood", "127.0.0.1:9")
        now = LOG_EVERY_SECONDS + 0.1
        guard.act("reset_flood", "127.0.0.1:9")
        guard.act("ping_flood", "127.0.0.1:9")
    lines = [(line["limit"], line["times_since_last_line"]) for line in logged if line["event"] == "grpc_limited"]
    assert lines == [("reset_flood", 1), ("reset_flood", 1_000), ("ping_flood", 1)]
    assert guard.limited == {"reset_flood": 1_001, "ping_flood": 1}
    assert len(seen) == 1_002


class _Peer:
    """A raw HTTP/2 client on a socket: h2 frames out, h2 events in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.reader, self.writer = reader, writer
        self.events: list[h2.events.Event] = []
        self.closed = False

    @classmethod
    async def connect(cls, port: int, *, preface: bool = True, source: str = "127.0.0.1") -> _Peer:
        peer = cls(*await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)))
        if preface:
            peer.h2.initiate_connection()
            peer.send()
            # The server's SETTINGS, acknowledged: h2 holds a peer to its raised stream limit only after that.
            await peer.read_until(lambda: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in peer.events))
        return peer

    def send(self) -> None:
        self.writer.write(self.h2.data_to_send())

    async def read_until(self, done: Callable[[], bool], *, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while not done() and not self.closed:
                try:
                    data = await self.reader.read(65_536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    self.closed = True
                    return
                self.events += self.h2.receive_data(data)
                self.send()

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        return next((e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)), None)

    def resets(self) -> dict[int, h2.errors.ErrorCodes | int]:
        return {e.stream_id: e.error_code for e in self.events if isinstance(e, h2.events.StreamReset)}

    def call(self, stream_id: int, path: str = IS_ACTIVE, *, body: bool = True) -> None:
        self.h2.send_headers(stream_id, request_headers(path), end_stream=not body)
        if body:
            self.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
        self.send()

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def peers() -> AsyncIterator[list[_Peer]]:
    """Raw peers a test opens, closed after it."""
    opened: list[_Peer] = []
    yield opened
    for peer in opened:
        peer.close()


async def _good_call(agent: Agent) -> bool:
    channel = Channel("127.0.0.1", agent.port)
    try:
        return (await ExternalScalerStub(channel).is_active(ScaledObjectRef(scaler_metadata={}), timeout=10)).result
    finally:
        channel.close()


def _guard(agent: Agent) -> ConnectionGuard:
    return agent.frontend.server.guard


def _cut_off(agent: Agent) -> dict[str, int]:
    """The limits that acted."""
    return dict(_guard(agent).limited)


async def test_a_stream_past_max_streams_is_refused_on_any_connection_and_the_rest_go_on(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """The stream past the limit over all connections is REFUSED_STREAM alone; a freed place takes a new one."""
    agent = await start_agent("--max-streams", "4")
    first = await _Peer.connect(agent.port)
    second = await _Peer.connect(agent.port)
    peers += [first, second]
    for stream_id in (1, 3, 5):
        first.call(stream_id, STREAM_IS_ACTIVE)
    await until(lambda: _guard(agent).streams == 3)
    second.call(1, STREAM_IS_ACTIVE)
    second.call(3, STREAM_IS_ACTIVE)  # the fifth over both connections
    await second.read_until(lambda: 3 in second.resets())
    assert second.resets() == {3: h2.errors.ErrorCodes.REFUSED_STREAM}
    assert second.goaway() is None
    assert not second.closed
    assert _guard(agent).limited["max_streams"] == 1
    first.h2.reset_stream(1)
    first.send()
    await until(lambda: _guard(agent).streams == 3)
    second.call(5, STREAM_IS_ACTIVE)  # a place is free again
    await until(lambda: _guard(agent).streams == 4)


async def test_a_reset_flood_is_told_to_calm_down_and_leaves_nothing_behind(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """Resets past the burst get GOAWAY ENHANCE_YOUR_CALM, and no stream or task of them stays."""
    agent = await start_agent("--max-resets-per-second", "10")
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    stream_id = 1
    while not peer.closed and peer.goaway() is None and stream_id < 2_000:
        peer.h2.send_headers(stream_id, request_headers(STREAM_IS_ACTIVE))
        peer.h2.send_data(stream_id, EMPTY_REF)
        peer.h2.reset_stream(stream_id)
        peer.send()
        stream_id += 2
        if stream_id % 50 == 1:
            await _drain(peer)
    await peer.read_until(lambda: peer.goaway() is not None)
    terminated = peer.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert stream_id > 2 * 10 * BURST_SECONDS  # the burst was allowed first
    assert _guard(agent).limited["reset_flood"] == 1
    server = agent.frontend.server
    await until(lambda: server.handler_tasks == 0 and server.open_streams == 0 and _guard(agent).streams == 0)
    assert await _good_call(agent) is False


def _headers(event: h2.events.ResponseReceived | h2.events.TrailersReceived) -> dict[str, str]:
    """An answer's headers: text, as the peer's h2 decodes them with header_encoding set."""
    return dict(cast(list[tuple[str, str]], event.headers))


def _answered(peer: _Peer) -> set[int]:
    """The streams on which the peer has received a message."""
    return {event.stream_id for event in peer.events if isinstance(event, h2.events.DataReceived)}


def _ended_more_than(peer: _Peer, count: int) -> bool:
    return sum(isinstance(e, h2.events.StreamEnded) for e in peer.events) > count


async def _drain(peer: _Peer) -> None:
    """Read what has arrived by now, without waiting for more."""
    try:
        async with asyncio.timeout(0.01):
            await peer.read_until(lambda: False)
    except TimeoutError:
        pass


async def test_a_ping_flood_is_told_to_calm_down_and_calls_earn_pings(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """A ping with every call is fine however many calls; a bare flood gets GOAWAY ENHANCE_YOUR_CALM."""
    agent = await start_agent("--max-pings-per-second", "5")
    polite = await _Peer.connect(agent.port)
    flood = await _Peer.connect(agent.port)
    peers += [polite, flood]
    for index in range(100):  # a ping per call, as gRPC clients do, far past the bare budget of 50
        polite.call(2 * index + 1)
        polite.h2.ping(struct.pack(">Q", index))
        polite.send()
        await polite.read_until(functools.partial(_ended_more_than, polite, index))
    assert polite.goaway() is None
    for index in range(200):
        flood.h2.ping(struct.pack(">Q", index))
    flood.send()
    await flood.read_until(lambda: flood.goaway() is not None)
    terminated = flood.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert _guard(agent).limited == {"ping_flood": 1}


async def test_an_idle_connection_gets_goaway_and_a_silent_one_is_closed(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """No stream for the idle timeout: GOAWAY NO_ERROR; no preface within the handshake timeout: closed."""
    agent = await start_agent("--idle-timeout", "0.3", "--handshake-timeout", "0.3")
    idle = await _Peer.connect(agent.port)
    silent = await _Peer.connect(agent.port, preface=False)
    peers += [idle, silent]
    await idle.read_until(lambda: idle.goaway() is not None)
    terminated = idle.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
    await silent.read_until(lambda: False)
    assert silent.closed
    assert _guard(agent).limited == {"idle_timeout": 1, "handshake_timeout": 1}
    await until(lambda: not _guard(agent).connections)


async def _caller(port: int) -> _Peer:
    """A raw peer that has made one call and been answered: no longer pending."""
    peer = await _Peer.connect(port)
    peer.call(1)
    await peer.read_until(lambda: any(isinstance(e, h2.events.StreamEnded) for e in peer.events))
    return peer


async def test_connections_past_the_limit_are_closed_at_once(start_agent: StartAgent, peers: list[_Peer]) -> None:
    """With every place held by connections that made calls, one past the limit is closed unanswered; once
    others close, calls get in again."""
    agent = await start_agent("--max-connections", "2")
    peers += [await _caller(agent.port), await _caller(agent.port)]
    await until(lambda: len(_guard(agent).connections) == 2 and not _guard(agent).pending)
    for _ in range(30):
        extra = await _Peer.connect(agent.port, preface=False)
        peers.append(extra)
        await extra.read_until(lambda: False)
        assert extra.closed
    assert _guard(agent).limited == {"max_connections": 30}
    # Nothing of a refused connection stays: grpclib drops closed handlers every 10 connections.
    assert len(agent.frontend.server._handlers) <= 2 + 10
    for peer in peers[:2]:
        peer.close()
    await until(lambda: not _guard(agent).connections)
    assert await _good_call(agent) is False


async def test_a_newcomer_displaces_the_oldest_connection_yet_to_make_a_call(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """With the pool full, a newcomer closes the oldest connection that has made no call (GOAWAY NO_ERROR after
    its preface) and is served; a connection that made a call keeps its place."""
    agent = await start_agent("--max-connections", "3", "--first-request-timeout", "60", "--idle-timeout", "60")
    served = await _caller(agent.port)
    oldest = await _Peer.connect(agent.port, source="127.0.0.2")
    younger = await _Peer.connect(agent.port, source="127.0.0.2")
    peers += [served, oldest, younger]
    await until(lambda: len(_guard(agent).connections) == 3)
    newcomer = await _caller(agent.port)
    peers.append(newcomer)
    await oldest.read_until(lambda: oldest.goaway() is not None)
    terminated = oldest.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert younger.goaway() is None
    assert served.goaway() is None
    assert _guard(agent).limited == {"displaced": 1}
    assert len(_guard(agent).connections) == 3


async def test_one_address_is_held_to_its_share_and_displaces_only_its_own(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """Past --max-connections-per-peer, an address's newcomer displaces that address's own oldest pending
    connection, or is refused when all of them have made calls; other addresses are untouched."""
    agent = await start_agent("--max-connections-per-peer", "2", "--first-request-timeout", "60")
    other = _Peer(*await asyncio.open_connection("127.0.0.1", agent.port, local_addr=("127.0.0.2", 0)))
    other.h2.initiate_connection()
    other.send()
    mine = [await _caller(agent.port), await _Peer.connect(agent.port)]
    peers += [other, *mine]
    await until(lambda: len(_guard(agent).connections) == 3)
    again = await _caller(agent.port)  # displaces this address's pending one, not 127.0.0.2's
    peers.append(again)
    await mine[1].read_until(lambda: mine[1].goaway() is not None)
    told = mine[1].goaway()
    assert told is not None
    assert (told.additional_data or b"").startswith(b"displaced"), told  # not "idle": it was not idle
    assert _guard(agent).limited == {"displaced": 1}
    refused = await _Peer.connect(agent.port, preface=False)  # both of this address's places have made calls
    peers.append(refused)
    await refused.read_until(lambda: False)
    assert refused.closed
    assert _guard(agent).limited == {"displaced": 1, "max_connections_per_peer": 1}
    table = _guard(agent).peers
    assert {address: table.connections(address) for address in ("127.0.0.1", "127.0.0.2")} == {
        "127.0.0.1": 2,
        "127.0.0.2": 1,
    }


async def test_a_connection_that_makes_no_call_after_its_preface_is_sent_goaway(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """A preface and no call within --first-request-timeout: GOAWAY NO_ERROR, long before the idle timeout; a
    connection that made a call stays."""
    agent = await start_agent("--first-request-timeout", "0.3", "--idle-timeout", "60")
    served = await _caller(agent.port)
    silent = await _Peer.connect(agent.port)
    peers += [served, silent]
    await silent.read_until(lambda: silent.goaway() is not None)
    terminated = silent.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert _guard(agent).limited == {"first_request_timeout": 1}
    assert served.goaway() is None
    assert not served.closed


async def test_a_protocol_error_is_answered_with_goaway_before_the_close(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """A connection error gets a GOAWAY with its code before the close (grpclib sent none)."""
    agent = await start_agent()
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    # WINDOW_UPDATE with a zero increment on the connection: a connection error (RFC 9113 6.9).
    peer.writer.write(struct.pack(">I", 4)[1:] + b"\x08\x00" + struct.pack(">II", 0, 0))
    await peer.read_until(lambda: False)
    terminated = peer.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert _guard(agent).limited == {"protocol_error": 1}


async def test_a_request_message_that_never_comes_ends_the_call(start_agent: StartAgent, peers: list[_Peer]) -> None:
    """Headers without a message for the request timeout: DEADLINE_EXCEEDED, and the slot is free."""
    agent = await start_agent("--request-timeout", "0.2")
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    peer.h2.send_headers(1, request_headers(IS_ACTIVE))  # and no message
    peer.send()
    await peer.read_until(lambda: any(isinstance(e, h2.events.StreamEnded) for e in peer.events))
    # A trailers-only answer: the status comes in the one block of headers.
    [answer] = [_headers(e) for e in peer.events if isinstance(e, h2.events.ResponseReceived)]
    assert answer["grpc-status"] == "4"  # DEADLINE_EXCEEDED
    assert _guard(agent).limited == {"request_timeout": 1}
    await until(lambda: _guard(agent).streams == 0)


async def test_a_call_whose_deadline_passed_on_arrival_is_deadline_exceeded(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """A deadline over before the call starts is DEADLINE_EXCEEDED with a content-type, counted so."""
    agent = await start_agent()
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    peer.h2.send_headers(1, [*request_headers(IS_ACTIVE), ("grpc-timeout", "1n")])
    peer.h2.send_data(1, EMPTY_REF, end_stream=True)
    peer.send()
    await peer.read_until(lambda: any(isinstance(e, h2.events.ResponseReceived) for e in peer.events))
    [answer] = [_headers(e) for e in peer.events if isinstance(e, h2.events.ResponseReceived)]
    assert (answer["grpc-status"], answer["content-type"]) == ("4", "application/grpc")
    assert agent.frontend.tracker.finished[(IS_ACTIVE, "DEADLINE_EXCEEDED")] == 1


async def test_a_deadline_that_runs_out_after_our_check_is_still_deadline_exceeded(
    start_agent: StartAgent, peers: list[_Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With our precheck passed (here: turned off), a deadline already over when grpclib starts the call ends
    OK or DEADLINE_EXCEEDED, not in grpclib's "Timeout occurred" error (UNKNOWN at the client)."""
    monkeypatch.setattr(calls, "EXPIRED_WITHIN_SECONDS", -1.0)
    agent = await start_agent()
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    peer.h2.send_headers(1, [*request_headers(IS_ACTIVE), ("grpc-timeout", "1n")])
    peer.h2.send_data(1, EMPTY_REF, end_stream=True)
    peer.send()
    await peer.read_until(lambda: any(isinstance(e, h2.events.StreamEnded) for e in peer.events))
    answers = [
        _headers(e) for e in peer.events if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived)
    ]
    # The handler may finish before the cancel scheduled for "now" runs: OK is a fair answer too.
    assert {a["grpc-status"] for a in answers if "grpc-status" in a} <= {"0", "4"}, answers
    finished = {code for method, code in agent.frontend.tracker.finished if method == IS_ACTIVE}
    assert finished <= {"OK", "DEADLINE_EXCEEDED"}, finished


# Stream ids for three times the reset burst an agent started with --max-resets-per-second 10 allows.
THREE_BURSTS_AT_10 = range(1, int(2 * 3 * 10 * BURST_SECONDS) + 1, 2)


@pytest.fixture
def slow_to_notice_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server too busy to end calls at their deadline before their resets are read."""

    @contextlib.contextmanager
    def never_ends(self: object, deadline: object) -> Iterator[None]:
        yield

    monkeypatch.setattr(calls._CancellingDeadlineWrapper, "start", never_ends)


@pytest.mark.usefixtures("slow_to_notice_deadlines")
@pytest.mark.parametrize(("deadline_resets", "cut_off"), [("1000", False), ("10", True)])
async def test_cancelling_calls_past_their_deadline_counts_in_the_looser_budget(
    start_agent: StartAgent, peers: list[_Peer], monkeypatch: pytest.MonkeyPatch, deadline_resets: str, cut_off: bool
) -> None:
    """A client cancels a call whose deadline passed before a slow server answered (grpcio and grpc-go do): three
    times the rapid-reset burst of such calls keeps the connection, as the server would have ended each call
    anyway; they still count, in --max-deadline-resets-per-second, and three times that burst is cut off."""
    monkeypatch.setattr(calls, "EXPIRED_WITHIN_SECONDS", -1.0)  # nor answered them as they arrived
    agent = await start_agent("--max-resets-per-second", "10", "--max-deadline-resets-per-second", deadline_resets)
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    ids = THREE_BURSTS_AT_10
    for stream_id in ids:  # the request message never comes: no call is answered before its reset
        peer.h2.send_headers(stream_id, [*request_headers(STREAM_IS_ACTIVE), ("grpc-timeout", "1m")])
    peer.send()
    opened = time.monotonic()
    await until(lambda: _guard(agent).streams == len(ids))
    await until(lambda: time.monotonic() - opened > 0.002)  # every deadline (1 ms) has passed
    for stream_id in ids:
        peer.h2.reset_stream(stream_id)
    peer.send()
    if cut_off:
        await peer.read_until(lambda: peer.goaway() is not None)
        assert _cut_off(agent) == {"deadline_reset_flood": 1}
        return
    await until(lambda: _guard(agent).streams == 0)
    assert peer.goaway() is None
    assert _cut_off(agent) == {}


@pytest.mark.usefixtures("slow_to_notice_deadlines")
@pytest.mark.parametrize("timeout", ["100m", "10S"])
async def test_a_reset_read_beside_its_headers_is_rapid_whatever_deadline_the_call_claims(
    start_agent: StartAgent, peers: list[_Peer], timeout: str
) -> None:
    """A call reset before it has lived most of its deadline abandons work it asked for: each call and its
    RST_STREAM in one write count as rapid resets whether the call claims 100 ms or 10 s, and three bursts are
    cut off (a fixed 100 ms slack once excused every 100 ms call)."""
    agent = await start_agent("--max-resets-per-second", "10")
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    ids = THREE_BURSTS_AT_10
    for stream_id in ids:  # each call and its reset in one write: read in the same turn
        peer.h2.send_headers(stream_id, [*request_headers(STREAM_IS_ACTIVE), ("grpc-timeout", timeout)])
        peer.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
        peer.h2.reset_stream(stream_id)
    peer.send()
    await peer.read_until(lambda: peer.goaway() is not None)
    assert _cut_off(agent) == {"reset_flood": 1}


@pytest.mark.usefixtures("slow_to_notice_deadlines")
@pytest.mark.parametrize(("deadline_resets", "cut_off"), [("1000", False), ("10", True)])
async def test_a_call_waiting_for_its_turn_lives_from_when_it_was_read(
    start_agent: StartAgent,
    peers: list[_Peer],
    monkeypatch: pytest.MonkeyPatch,
    deadline_resets: str,
    cut_off: bool,
) -> None:
    """300 calls of 100 ms read at once, taken in a call a turn (--turn-calls 1) by a loop that is then busy for
    longer than their deadline, and each reset by its client at that deadline: each call has lived its deadline
    from when it was read, though its turn came just before its reset, so the resets count in the deadline
    budget (cut off only past it), not as rapid resets."""
    monkeypatch.setattr(calls, "EXPIRED_WITHIN_SECONDS", -1.0)  # nor answered them as they arrived
    busy = asyncio.Event()
    take_turn = protocol.ManyStreamsProtocol._take_turn

    def then_busy(self: protocol.ManyStreamsProtocol, data: bytes) -> bool:
        more = take_turn(self, data)
        if more and not busy.is_set():
            busy.set()
            time.sleep(0.15)  # the loop busy elsewhere (a full collection, another peer) for 1.5 deadlines
        return more

    monkeypatch.setattr(protocol.ManyStreamsProtocol, "_take_turn", then_busy)
    agent = await start_agent(
        "--turn-calls", "1", "--max-resets-per-second", "10", "--max-deadline-resets-per-second", deadline_resets
    )
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    ids = THREE_BURSTS_AT_10
    for stream_id in ids:  # the request message never comes: no call is answered before its reset
        peer.h2.send_headers(stream_id, [*request_headers(STREAM_IS_ACTIVE), ("grpc-timeout", "100m")])
    peer.send()
    sent = time.monotonic()
    await busy.wait()
    assert time.monotonic() - sent > 0.1  # every deadline has passed, most calls still unread by their turns
    for stream_id in ids:
        peer.h2.reset_stream(stream_id)
    peer.send()
    if cut_off:
        await peer.read_until(lambda: peer.goaway() is not None)
        assert _cut_off(agent) == {"deadline_reset_flood": 1}
        return
    await until(lambda: _guard(agent).streams == 0 and agent.frontend.server.handler_tasks == 0)
    assert peer.goaway() is None
    assert _cut_off(agent) == {}


async def test_reconnecting_does_not_refill_a_peers_reset_budget(start_agent: StartAgent, peers: list[_Peer]) -> None:
    """The reset budget is the peer address's: 80 rapid resets on one connection, then a new connection from
    the same address is cut off well before a fresh burst (100) would have run out."""
    agent = await start_agent("--max-resets-per-second", "10")
    first = await _Peer.connect(agent.port)
    peers.append(first)
    for stream_id in range(1, 161, 2):
        first.h2.send_headers(stream_id, request_headers(STREAM_IS_ACTIVE))
        first.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
        first.h2.reset_stream(stream_id)
    first.send()
    await until(lambda: _guard(agent).streams == 0 and agent.frontend.server.handler_tasks == 0)
    first.call(161)
    await first.read_until(functools.partial(_ended_more_than, first, 0))  # every reset before it was read
    assert first.goaway() is None
    first.close()
    second = await _Peer.connect(agent.port)
    peers.append(second)
    for stream_id in range(1, 301, 2):
        second.h2.send_headers(stream_id, request_headers(STREAM_IS_ACTIVE))
        second.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
        second.h2.reset_stream(stream_id)
    second.send()
    await second.read_until(lambda: second.goaway() is not None)
    terminated = second.goaway()
    assert terminated is not None
    assert terminated.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert (terminated.last_stream_id or 0) < 2 * 10 * BURST_SECONDS, terminated  # not a fresh burst of 100
    assert _cut_off(agent) == {"reset_flood": 1}


async def test_a_connection_starts_at_most_its_turn_budget_of_calls_per_turn(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """200 calls in one write are started --turn-calls (4) a turn of the event loop at most, the deferred turns
    counted apart from the limits; every call is answered: the budget reorders, it refuses nothing."""
    agent = await start_agent("--turn-calls", "4")
    loop, guard = asyncio.get_running_loop(), _guard(agent)
    turns = [0]

    def tick() -> None:  # runs once per turn of the loop
        turns[0] += 1
        ticking[0] = loop.call_soon(tick)

    ticking = [loop.call_soon(tick)]
    started_in: Counter[int] = Counter()
    admit = guard.admit_stream

    def counting(*, streaming: bool) -> bool:
        started_in[turns[0]] += 1
        return admit(streaming=streaming)

    guard.admit_stream = counting  # type: ignore[method-assign]
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    ids = range(1, 401, 2)
    try:
        for stream_id in ids:
            peer.h2.send_headers(stream_id, request_headers(IS_ACTIVE))
            peer.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
        peer.send()
        await peer.read_until(functools.partial(_ended_more_than, peer, len(ids) - 1))
    finally:
        ticking[0].cancel()
    assert sum(started_in.values()) == len(ids)
    assert max(started_in.values()) <= 4, started_in
    assert guard.turns_deferred >= 1
    assert peer.resets() == {}
    assert _cut_off(agent) == {}


async def test_a_connection_that_goes_while_its_backlog_waits_takes_nothing_more_in(
    start_agent: StartAgent, peers: list[_Peer]
) -> None:
    """Thousands of calls in one write are taken in a turn's budget at a time; a peer that goes meanwhile leaves
    the rest unread, with no error from feeding a closed connection."""
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    agent = await start_agent()
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    for stream_id in range(1, 2 * 2_000, 2):
        peer.h2.send_headers(stream_id, request_headers(IS_ACTIVE))
        peer.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
    peer.send()
    peer.writer.transport.abort()
    server = agent.frontend.server
    await until(lambda: not _guard(agent).connections and server.handler_tasks == 0)
    assert await _good_call(agent) is False
    assert errors == []


async def test_an_error_in_a_deferred_turn_is_logged_and_drops_the_connection(
    start_agent: StartAgent, peers: list[_Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while a connection's later turn takes in its frames goes to the loop's exception handler as a
    failed data_received would, and the connection is dropped, not left open with its reading paused."""
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    receive_turn = BoundedH2Connection.receive_turn

    def failing_later(self: BoundedH2Connection, data: bytes, calls: int, size: int) -> tuple[list[Event], bool]:
        if not data:  # a deferred turn: what it takes in was read before
            raise RuntimeError("a bug in a deferred turn")
        return receive_turn(self, data, calls, size)

    monkeypatch.setattr(BoundedH2Connection, "receive_turn", failing_later)
    agent = await start_agent("--turn-calls", "1")
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    for stream_id in range(1, 21, 2):
        peer.h2.send_headers(stream_id, request_headers(IS_ACTIVE))
        peer.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
    peer.send()
    await peer.read_until(lambda: False)
    assert peer.closed
    await until(lambda: not _guard(agent).connections and agent.frontend.server.handler_tasks == 0)
    assert [str(e.get("exception")) for e in errors] == ["a bug in a deferred turn"]
    assert await _good_call(agent) is False


@pytest.mark.parametrize("why", ["held a while", "answered"])
async def test_resetting_streams_that_abandon_no_work_is_no_flood(
    start_agent: StartAgent, peers: list[_Peer], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Hundreds of push streams reset at once keep the connection when the resets abandon no work: streams held
    a while (KEDA when ScaledObjects go), or streams each already answered however new (a client closing its
    channel a moment after opening them). Unanswered new ones would count."""
    if why == "held a while":
        monkeypatch.setattr(protocol, "RAPID_RESET_SECONDS", 0.0)  # every stream here counts as held a while
    agent = await start_agent("--max-resets-per-second", "10")
    peer = await _Peer.connect(agent.port)
    peers.append(peer)
    ids = range(1, 601, 2)
    for stream_id in ids:
        peer.call(stream_id, STREAM_IS_ACTIVE)
    if why == "answered":
        await peer.read_until(lambda: _answered(peer) == set(ids))  # each stream's first message
    else:
        await until(lambda: _guard(agent).streams == len(ids))
    for stream_id in ids:  # three times the burst of 100
        peer.h2.reset_stream(stream_id)
    peer.send()
    await until(lambda: _guard(agent).streams == 0)
    peer.call(ids[-1] + 2)
    await peer.read_until(functools.partial(_ended_more_than, peer, 0))
    assert peer.goaway() is None
    assert _cut_off(agent) == {}
