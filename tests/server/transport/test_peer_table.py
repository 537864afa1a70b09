"""PeerBudgets: reset budgets kept per peer address, over its connections, in a bounded table."""

from __future__ import annotations

import dataclasses

from gpuscaler.flags import DEFAULT_LIMITS
from gpuscaler.server.transport.limits import BURST_SECONDS
from gpuscaler.server.transport.peer_budgets import PeerBudgets

LIMITS = dataclasses.replace(DEFAULT_LIMITS, max_resets_per_second=1, max_deadline_resets_per_second=3)


def test_each_address_has_its_own_two_budgets() -> None:
    """An address spends its rapid budget (1/s, burst 10) and its deadline budget (3/s, burst 30) apart, and
    another address's are untouched."""
    budgets = PeerBudgets(LIMITS)
    assert all(budgets.take_rapid("10.0.0.1", 0.0) for _ in range(int(BURST_SECONDS)))
    assert not budgets.take_rapid("10.0.0.1", 0.0)
    assert all(budgets.take_deadline("10.0.0.1", 0.0) for _ in range(int(3 * BURST_SECONDS)))
    assert not budgets.take_deadline("10.0.0.1", 0.0)
    assert budgets.take_rapid("10.0.0.2", 0.0)
    assert budgets.take_rapid("10.0.0.1", 1.0)  # a second later: one more


def test_the_table_is_bounded_and_forgets_the_address_used_longest_ago() -> None:
    """Past its size the table drops the address used longest ago (whose budget then starts full); using an
    address keeps it."""
    budgets = PeerBudgets(LIMITS, size=2)
    for _ in range(int(BURST_SECONDS)):
        budgets.take_rapid("a", 0.0)
        budgets.take_rapid("b", 0.0)
    assert not budgets.take_rapid("a", 0.0)  # "a" used last: "b" is the oldest now
    budgets.take_rapid("c", 0.0)
    assert len(budgets) == 2
    assert not budgets.take_rapid("a", 0.0)  # kept, still spent
    assert budgets.take_rapid("b", 0.0)  # forgotten: a full budget again
