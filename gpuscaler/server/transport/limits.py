"""What one gRPC peer may hold or send, enforced: connections, streams, floods, silence and unread output.

grpclib and h2 put no bound on any of these (docs/security.md has the report for upstream), so a peer that
floods, resets, never reads or never speaks could grow the process without limit or stall the event loop
that every other caller and the poll loop share. ``ConnectionGuard`` is the server-wide half: it admits
connections and streams against ``ConnectionLimits`` (the pool, each address's share of it, and the small
share that connections yet to make a call may hold, the oldest of them giving way to a newcomer), runs one
sweep for the timeouts of every connection, and records each time a limit acts (a count per limit, and one
log line per limit per interval, so an attack cannot flood the log either) and each read left in part for a
connection's later turns (counted apart: that reorders, it refuses nothing). Its ``PeerTable`` keeps each
address's connections and reset budgets. The protocol in ``protocol`` is the per-connection half: it takes in
frames a turn's budget at a time, counts resets into its address's budgets and PINGs into its own, and asks the
guard.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from gpuscaler.flags import ConnectionLimits
from gpuscaler.server.overload import LimitsActed, LogEvery
from gpuscaler.server.transport.peer_table import PeerTable

# The label values of gpuscaler_grpc_limited_total, one per limit that can act.
LIMITS = (
    "handshake_timeout",
    "idle_timeout",
    "max_connections",
    "max_connections_per_peer",
    "max_pending_connections",
    "displaced",
    "first_request_timeout",
    "max_streams",
    "request_timeout",
    "reset_flood",
    "deadline_reset_flood",
    "ping_flood",
    "write_stalled",
    "protocol_error",
)
# A pending connection's own address may replace it with a newer one only after this long: until then a newcomer
# from that address, with the pool or the pending share full, is refused at accept, so that a stranger reconnecting
# as fast as it can neither churns the share nor keeps its own connections young (a fresh caller is never the
# oldest). Displacing instead was measured (bench/results/attacks-connections-displace-own.json): every newcomer
# then builds its HTTP/2 state before it is displaced, 50,000 of them in 30 s, and the agent's RSS went from 36 to
# 180-220 MiB and the good caller's p99 to 70-84 ms, against 44 MiB and 10 ms with the refusal.
PENDING_GRACE_SECONDS = 1.0
# Places beyond --max-streams that only unary calls may take: KEDA holds its push streams and polls on one
# connection, and a call refused beside them is a scaler error.
CALL_RESERVE = 256
# Each call the server accepts lets its peer send this many more PINGs: gRPC clients measure the connection's
# bandwidth-delay product with one PING per burst of data they receive (grpc-go allows it the same way).
PINGS_PER_CALL = 2
SWEEP_MIN_SECONDS = 0.05
SWEEP_MAX_SECONDS = 1.0


class Guarded(Protocol):
    """What the sweep reads and does on one connection (``protocol.ManyStreamsProtocol``)."""

    accepted_at: float
    preface_done: bool
    preface_at: float
    called: bool
    last_stream_at: float
    write_stalled_since: float | None
    peer: str

    @property
    def address(self) -> str:  # the peer's IP: the key of its PeerTable entry
        ...

    def open_streams(self) -> int: ...

    def go_away_idle(self, reason: str = ...) -> None: ...

    def abort(self) -> None: ...


class ConnectionGuard:
    """The server-wide bookkeeping of ``ConnectionLimits``: admission, the sweep, and what acted."""

    def __init__(self, limits: ConnectionLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.connections: set[Guarded] = set()
        # Admitted connections that have not made a call yet (TLS handshake, preface, first request), oldest
        # first: strangers until then (with mTLS, unauthenticated until the handshake, which precedes any call).
        self.pending: dict[Guarded, None] = {}
        self.peers = PeerTable(limits)  # each address's connections, pending ones and reset budgets
        self.leaving: set[Guarded] = set()  # told GOAWAY and given a moment to read it: no longer counted
        self.streams = 0  # streams accepted and not yet finished, over all connections
        self.push_streams = 0  # those of them that are server streams (StreamIsActive, WatchSnapshots)
        self._acted = LimitsActed("grpc_limited", LIMITS, clock=clock)
        self.limited = self._acted.counts
        self.on_limited = self._acted.observers
        # Reads whose frames were more than one turn's budget (--turn-calls, --turn-bytes), the rest left for the
        # connection's later turns. Not a limit acting: nothing is refused, only reordered, and KEDA's own calls
        # on its one connection do it whenever they come together; so it is counted apart and logged at info.
        self.turns_deferred = 0
        self._deferred_log = LogEvery("grpc_turn_deferred", clock=clock, level="info")
        self._sweep: asyncio.Task[None] | None = None

    def admit_connection(self, connection: Guarded) -> bool:
        """Count a new connection; False past its limit (the caller drops it).

        Where a limit is reached, a connection that has made no call yet gives way to the newcomer
        (``displaced``): for an address's own limit, that address's oldest. Otherwise (the pool, or the pending
        share, full) the newcomer's own address's oldest once it has had PENDING_GRACE_SECONDS, and if that
        address has a younger one, the newcomer is refused (``max_pending_connections``): one place on its way to
        a first call per address at a time, so strangers reconnecting as fast as they can are turned away cheaply,
        before any HTTP/2 state is built, instead of churning the share. A newcomer from an address with none
        displaces the oldest of the address holding the most. A real client makes its first call within
        milliseconds, so it is never the oldest. Where every place is held by connections that have made calls,
        the newcomer is refused (``max_connections``, ``max_connections_per_peer``).
        """
        limits, address = self.limits, connection.address
        peer = self.peers.of(address, self.clock())
        if peer.connections >= limits.max_connections_per_peer:
            victim = self._oldest_pending(address)
            if victim is None:
                self.act("max_connections_per_peer", connection.peer, open=peer.connections)
                return False
            self._displace(victim, connection)
        elif len(self.connections) >= limits.max_connections or len(self.pending) >= limits.max_pending_connections:
            mine = self._oldest_pending(address)
            if mine is not None and self.clock() - mine.accepted_at < PENDING_GRACE_SECONDS:
                self.act("max_pending_connections", connection.peer, pending=len(self.pending))
                return False
            victim = mine if mine is not None else self._oldest_pending(self._most_pending())
            if victim is None:
                self.act("max_connections", connection.peer, open=len(self.connections))
                return False
            self._displace(victim, connection)
        self.connections.add(connection)
        if not connection.called:
            self.pending[connection] = None
            peer.pending += 1
        peer.connections += 1
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().create_task(self._run_sweep(), name="grpc-connection-sweep")
        return True

    def first_call(self, connection: Guarded) -> None:
        """``connection`` has made its first call: it no longer counts as pending, nor can it be displaced."""
        connection.called = True
        self._unpend(connection)

    def _unpend(self, connection: Guarded) -> None:
        if connection in self.pending:
            del self.pending[connection]
            self.peers.of(connection.address, self.clock()).pending -= 1

    def _oldest_pending(self, address: str | None) -> Guarded | None:
        return next((c for c in self.pending if c.address == address), None)

    def _most_pending(self) -> str | None:
        # The address holding the most pending connections (of those tied, the one holding the oldest).
        counts = Counter(c.address for c in self.pending)  # in the order of each address's oldest
        most = max(counts.values(), default=0)
        return next((address for address, count in counts.items() if count == most), None)

    def _displace(self, victim: Guarded, newcomer: Guarded) -> None:
        # Close ``victim``, a pending connection, to make room for ``newcomer``.
        self.act(
            "displaced",
            victim.peer,
            by=newcomer.peer,
            held_seconds=round(self.clock() - victim.accepted_at, 3),
            preface=victim.preface_done,
        )
        self._forget(victim)
        if victim.preface_done:
            victim.go_away_idle("displaced: no call yet, and its place was wanted")  # a gRPC client retries
        else:
            victim.abort()

    def _forget(self, connection: Guarded) -> None:
        if connection in self.connections:
            self.connections.discard(connection)
            self._unpend(connection)
            self.peers.of(connection.address, self.clock()).connections -= 1

    def release_connection(self, connection: Guarded) -> None:
        self._forget(connection)
        self.leaving.discard(connection)

    def see_off(self, connection: Guarded) -> None:
        """Stop counting a connection told to go; ``close`` drops it if its grace has not run out by then."""
        self._forget(connection)
        self.leaving.add(connection)

    def admit_stream(self, *, streaming: bool) -> bool:
        """Count a new stream; False past its limit (the caller refuses it).

        Push streams may take ``max_streams`` places, and all streams together CALL_RESERVE more, so KEDA's
        GetMetrics still gets in beside the most push streams it may hold.
        """
        if self.streams >= self.limits.max_streams + CALL_RESERVE:
            return False
        if streaming:
            if self.push_streams >= self.limits.max_streams:
                return False
            self.push_streams += 1
        self.streams += 1
        return True

    def release_stream(self, *, streaming: bool) -> None:
        self.streams -= 1
        if streaming:
            self.push_streams -= 1

    def defer_turn(self, peer: str, **detail: object) -> None:
        """Count that ``peer``'s read held more than a turn's budget; log it at info once per interval."""
        self.turns_deferred += 1
        self._deferred_log(peer=peer, **detail)

    def act(self, limit: str, peer: str, **detail: object) -> None:
        """Count that ``limit`` acted on ``peer``; log it unless it was logged within LOG_EVERY_SECONDS."""
        self._acted(limit, peer=peer, **detail)

    def sweep_every_seconds(self) -> float:
        limits = self.limits
        shortest = min(
            limits.handshake_timeout_seconds,
            limits.first_request_timeout_seconds,
            limits.idle_timeout_seconds,
            limits.write_timeout_seconds,
        )
        return min(SWEEP_MAX_SECONDS, max(SWEEP_MIN_SECONDS, shortest / 4))

    def sweep(self) -> None:
        """Close the connections past a timeout: no preface yet, no first call, idle, or not reading what they are sent.

        The first call's deadline is much shorter than the idle timeout: a connection that never made a call has
        shown nothing of being a client, while one that did is KEDA's or the gateway's between calls.
        """
        now, limits = self.clock(), self.limits
        for connection in list(self.connections):
            if not connection.preface_done:
                if now - connection.accepted_at > limits.handshake_timeout_seconds:
                    self.act("handshake_timeout", connection.peer, seconds=limits.handshake_timeout_seconds)
                    self.release_connection(connection)
                    connection.abort()
            elif connection.write_stalled_since is not None:
                if now - connection.write_stalled_since > limits.write_timeout_seconds:
                    self.act("write_stalled", connection.peer, seconds=limits.write_timeout_seconds)
                    self.release_connection(connection)
                    connection.abort()
            elif (
                not connection.called
                and connection.open_streams() == 0
                and now - connection.preface_at > limits.first_request_timeout_seconds
                and now - connection.last_stream_at <= limits.idle_timeout_seconds
            ):
                self.act("first_request_timeout", connection.peer, seconds=limits.first_request_timeout_seconds)
                self.release_connection(connection)
                connection.go_away_idle("no call within the first-request timeout")
            elif connection.open_streams() == 0 and now - connection.last_stream_at > limits.idle_timeout_seconds:
                self.act("idle_timeout", connection.peer, seconds=limits.idle_timeout_seconds)
                self.release_connection(connection)
                connection.go_away_idle()

    async def _run_sweep(self) -> None:
        every = self.sweep_every_seconds()
        while True:
            await asyncio.sleep(every)
            self.sweep()

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for connection in list(self.leaving):  # a server stopping gives no grace: their sockets go with it
            connection.abort()
        self.leaving.clear()
