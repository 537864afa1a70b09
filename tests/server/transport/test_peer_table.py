"""PeerTable: each peer address's connections and reset budgets, over its connections, in one bounded table."""

from __future__ import annotations

import dataclasses

from gpuscaler.flags import DEFAULT_LIMITS
from gpuscaler.server.transport.peer_table import BURST_SECONDS, PeerTable

LIMITS = dataclasses.replace(DEFAULT_LIMITS, max_resets_per_second=1, max_deadline_resets_per_second=3)


def test_each_address_has_its_own_two_budgets() -> None:
    """An address spends its rapid budget (1/s, burst 10) and its deadline budget (3/s, burst 30) apart, and
    another address's are untouched."""
    table = PeerTable(LIMITS)
    assert all(table.take_rapid("10.0.0.1", 0.0) for _ in range(int(BURST_SECONDS)))
    assert not table.take_rapid("10.0.0.1", 0.0)
    assert all(table.take_deadline("10.0.0.1", 0.0) for _ in range(int(3 * BURST_SECONDS)))
    assert not table.take_deadline("10.0.0.1", 0.0)
    assert table.take_rapid("10.0.0.2", 0.0)
    assert table.take_rapid("10.0.0.1", 1.0)  # a second later: one more


def test_the_table_is_bounded_and_forgets_the_address_used_least_recently() -> None:
    """Past its size the table drops the address used least recently (whose budget then starts full); using an
    address keeps it."""
    table = PeerTable(LIMITS, size=2)
    for _ in range(int(BURST_SECONDS)):
        table.take_rapid("a", 0.0)
        table.take_rapid("b", 0.0)
    assert not table.take_rapid("a", 0.0)  # "a" used last: "b" is the least recent now
    table.take_rapid("c", 0.0)
    assert len(table) == 2
    assert not table.take_rapid("a", 0.0)  # kept, still spent
    assert table.take_rapid("b", 0.0)  # forgotten: a full budget again


def test_an_address_holding_connections_is_never_forgotten() -> None:
    """The least recently used address is kept while it holds a connection (its count is needed when that
    closes): the next one without a connection goes instead, and its spent budget with it only."""
    table = PeerTable(LIMITS, size=2)
    table.of("held", 0.0).connections = 1
    for _ in range(int(BURST_SECONDS)):
        table.take_rapid("held", 0.0)
    table.take_rapid("b", 0.0)
    table.take_rapid("c", 0.0)
    assert len(table) == 2
    assert table.connections("held") == 1
    assert not table.take_rapid("held", 0.0)  # its spent budget kept with it
    assert table.connections("b") == 0
