"""Each peer address's share of the server, in one table: its connections, those yet to make a call, its reset budgets.

Keyed by the peer's IP alone (``protocol.ManyStreamsProtocol.address``, from the socket's peer name), so the
per-address connection caps and the reset budgets count the same peer. A budget kept per connection starts full on
every new connection: a peer that reconnects before it runs out (one connection per 1,000 rapid resets) is never
cut off; kept here, it outlives the connection. The table holds PEER_TABLE_SIZE addresses with no connection at
most; past it, the one used longest ago (least recently) is forgotten. An address with connections open is never
forgotten (its counts are needed when they close), and at most ``--max-connections`` of them exist. An entry unused
for BURST_SECONDS has refilled completely, so forgetting it loses nothing; a peer that has more addresses than the
table can reset at each one's full rate, which is what the connection caps and the NetworkPolicy bound.
"""

from __future__ import annotations

from collections import OrderedDict

from gpuscaler.flags import ConnectionLimits

# A bucket holds this many seconds of its rate: a peer may burst, but not keep it up.
BURST_SECONDS = 10.0
# Addresses kept without a connection: about 250 bytes each, so the table stays around a megabyte.
PEER_TABLE_SIZE = 4096


class TokenBucket:
    """``rate`` tokens a second, at most ``rate * BURST_SECONDS`` kept; ``take`` is False once they run out."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate: float, now: float) -> None:
        self._rate = rate
        self._burst = rate * BURST_SECONDS
        self._tokens = self._burst
        self._stamp = now

    def take(self, now: float) -> bool:
        if self._tokens < 1.0:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            if self._tokens < 1.0:
                return False
        self._tokens -= 1.0
        return True

    def give(self, tokens: float) -> None:
        self._tokens = min(self._burst, self._tokens + tokens)


class Peer:
    """One address: its connections and those of them yet to make a call, and its two reset budgets (rapid
    resets, and the looser one for resets at the call's own deadline)."""

    __slots__ = ("connections", "deadline", "pending", "rapid")

    def __init__(self, limits: ConnectionLimits, now: float) -> None:
        self.connections = 0
        self.pending = 0
        self.rapid = TokenBucket(limits.max_resets_per_second, now)
        self.deadline = TokenBucket(limits.max_deadline_resets_per_second, now)


class PeerTable:
    """Every peer address the server holds a connection from or has seen lately, least recently used first."""

    def __init__(self, limits: ConnectionLimits, *, size: int = PEER_TABLE_SIZE) -> None:
        self._limits = limits
        self._size = size
        self._table: OrderedDict[str, Peer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def connections(self, address: str) -> int:
        """How many connections ``address`` holds (0 for one not in the table)."""
        peer = self._table.get(address)
        return peer.connections if peer is not None else 0

    def pending(self) -> dict[str, int]:
        """The addresses holding connections yet to make a call, and how many each."""
        return {address: peer.pending for address, peer in self._table.items() if peer.pending}

    def take_rapid(self, address: str, now: float) -> bool:
        """Spend one rapid reset of ``address``'s budget; False once it is spent."""
        return self.of(address, now).rapid.take(now)

    def take_deadline(self, address: str, now: float) -> bool:
        """Spend one reset at its call's deadline of ``address``'s (looser) budget; False once it is spent."""
        return self.of(address, now).deadline.take(now)

    def of(self, address: str, now: float) -> Peer:
        """``address``'s entry, made if new, and marked the most recently used."""
        peer = self._table.get(address)
        if peer is not None:
            self._table.move_to_end(address)
            return peer
        peer = self._table[address] = Peer(self._limits, now)
        if len(self._table) > self._size:
            self._forget_one()
        return peer

    def _forget_one(self) -> None:
        # The least recently used address holding no connection. Those holding one are skipped: at most
        # --max-connections of them, and used recently, so near the end.
        for address, peer in self._table.items():
            if not peer.connections:
                del self._table[address]
                return
