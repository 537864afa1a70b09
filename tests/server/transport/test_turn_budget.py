"""The guard's turn budget: --turn-calls while connections share the loop, more for one that has had it alone."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from gpuscaler.flags import DEFAULT_LIMITS
from gpuscaler.server.transport.limits import ALONE_SECONDS, ALONE_TURN_FACTOR, ConnectionGuard, Guarded


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def connection() -> Guarded:
    """A stand-in connection: the budget knows connections only by identity."""
    return cast(Guarded, object())


def test_a_connection_alone_for_a_while_gets_a_larger_budget() -> None:
    """A connection that alone has taken turns for ALONE_SECONDS gets ALONE_TURN_FACTOR times --turn-calls."""
    clock = Clock()
    guard = ConnectionGuard(replace(DEFAULT_LIMITS, turn_calls=2), clock=clock)
    busy = connection()
    assert guard.turn_calls(busy) == 2
    clock.now += ALONE_SECONDS / 2
    assert guard.turn_calls(busy) == 2
    clock.now += ALONE_SECONDS
    assert guard.turn_calls(busy) == 2 * ALONE_TURN_FACTOR


def test_another_connections_turn_ends_the_larger_budget_at_once() -> None:
    """As soon as another connection takes a turn, every connection is back to --turn-calls until one has been
    alone for ALONE_SECONDS again."""
    clock = Clock()
    guard = ConnectionGuard(replace(DEFAULT_LIMITS, turn_calls=2), clock=clock)
    busy, other = connection(), connection()
    guard.turn_calls(busy)
    clock.now += 2 * ALONE_SECONDS
    assert guard.turn_calls(busy) == 2 * ALONE_TURN_FACTOR
    assert guard.turn_calls(other) == 2
    assert guard.turn_calls(busy) == 2
    clock.now += ALONE_SECONDS / 2
    assert guard.turn_calls(busy) == 2
    clock.now += ALONE_SECONDS
    assert guard.turn_calls(busy) == 2 * ALONE_TURN_FACTOR
