"""Each peer address's reset budgets, kept across its connections in a table bounded in size and evicted by age.

A budget kept per connection starts full on every new connection: a peer that reconnects before it runs out
(one connection per 1,000 rapid resets) is never cut off. Kept per address (the IP, not the port), the budget
outlives the connection. The table holds PEER_TABLE_SIZE addresses at most; the one used longest ago goes
first. An entry unused for BURST_SECONDS has refilled completely, so evicting it forgets nothing; a peer that
has more addresses than the table can reset at each one's full rate, which is what the connection caps and
the NetworkPolicy bound.
"""

from __future__ import annotations

from collections import OrderedDict

from gpuscaler.flags import ConnectionLimits
from gpuscaler.server.transport.limits import TokenBucket

# Addresses whose budgets are kept: about 200 bytes each, so the table stays under a megabyte.
PEER_TABLE_SIZE = 4096


class _Budgets:
    """One address's two buckets: rapid resets, and the looser one for resets at the call's own deadline."""

    __slots__ = ("deadline", "rapid")

    def __init__(self, limits: ConnectionLimits, now: float) -> None:
        self.rapid = TokenBucket(limits.max_resets_per_second, now)
        self.deadline = TokenBucket(limits.max_deadline_resets_per_second, now)


class PeerBudgets:
    """The reset budgets of every peer address the server has seen lately, over all its connections."""

    def __init__(self, limits: ConnectionLimits, *, size: int = PEER_TABLE_SIZE) -> None:
        self._limits = limits
        self._size = size
        self._table: OrderedDict[str, _Budgets] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def take_rapid(self, address: str, now: float) -> bool:
        """Spend one rapid reset of ``address``'s budget; False once it is spent."""
        return self._of(address, now).rapid.take(now)

    def take_deadline(self, address: str, now: float) -> bool:
        """Spend one reset at its call's deadline of ``address``'s (looser) budget; False once it is spent."""
        return self._of(address, now).deadline.take(now)

    def _of(self, address: str, now: float) -> _Budgets:
        budgets = self._table.get(address)
        if budgets is not None:
            self._table.move_to_end(address)
            return budgets
        budgets = self._table[address] = _Budgets(self._limits, now)
        if len(self._table) > self._size:
            self._table.popitem(last=False)  # the address used longest ago
        return budgets
