"""Hysteresis: next_state over value sequences, and ActivationStates keyed by query."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from gpuscaler.query.query import ActivationRule
from gpuscaler.signals.activation import ActivationStates, Transition, next_state


def states(values: list[float], rule: ActivationRule) -> list[bool]:
    """The state after each value, starting from first sight."""
    seen: list[bool] = []
    previous: bool | None = None
    for value in values:
        previous = next_state(previous, value, rule)
        seen.append(previous)
    return seen


T, F = True, False


@pytest.mark.parametrize(
    ("rule", "values", "expected"),
    [
        pytest.param(
            ActivationRule(10.0, 5.0),
            [0.0, 10.0, 10.1, 7.0, 5.01, 5.0, 6.0, 10.0, 11.0],
            [F, F, T, T, T, F, F, F, T],
            id="hysteresis-band",
        ),
        pytest.param(ActivationRule(10.0, 5.0), [7.0, 12.0, 7.0], [F, T, T], id="band-keeps-the-state"),
        pytest.param(ActivationRule(10.0, 5.0), [12.0, 4.0, 7.0, 9.9], [T, F, F, F], id="down-then-band"),
        pytest.param(ActivationRule(5.0, 5.0), [5.0, 6.0, 5.0, 4.0, 5.5], [F, T, F, F, T], id="no-hysteresis"),
        pytest.param(ActivationRule(0.0, 0.0), [0.0, 0.1, 0.0, 0.001], [F, T, F, T], id="any-work-is-active"),
        pytest.param(ActivationRule(1.0, 0.0), [2.0, 0.5, 0.0, 0.5], [T, T, F, F], id="batch-profile"),
        pytest.param(ActivationRule(10.0, 5.0), [1e9, 0.0], [T, F], id="extremes"),
    ],
)
def test_hysteresis(rule: ActivationRule, values: list[float], expected: list[bool]) -> None:
    """Active once value > activationThreshold; inactive again only once value <= deactivationThreshold."""
    assert states(values, rule) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(4.0, F, id="below-both"),
        pytest.param(5.0, F, id="at-deactivation"),
        pytest.param(7.0, F, id="inside-band"),
        pytest.param(10.0, F, id="at-activation"),
        pytest.param(10.5, T, id="above-activation"),
    ],
)
def test_first_sight_uses_the_activation_threshold(value: float, expected: bool) -> None:
    """A query seen for the first time is active only above activationThreshold, even inside the band."""
    assert next_state(None, value, ActivationRule(10.0, 5.0)) is expected


RULE = ActivationRule(10.0, 5.0)


def test_observe_reports_first_sight_then_changes() -> None:
    """observe() says first on the first value, then whether each value changed the state."""
    registry = ActivationStates(idle_seconds=100.0)
    seen = [registry.observe("q", value, RULE, now=0.0) for value in (20.0, 7.0, 3.0, 3.0, 11.0)]
    assert seen == [
        Transition(active=True, changed=False, first=True),
        Transition(active=True, changed=False, first=False),
        Transition(active=False, changed=True, first=False),
        Transition(active=False, changed=False, first=False),
        Transition(active=True, changed=True, first=False),
    ]
    assert len(registry) == 1


def test_states_are_kept_per_key() -> None:
    """Two queries keep their own states: one going active does not move the other."""
    registry = ActivationStates(idle_seconds=100.0)
    registry.observe("a", 20.0, RULE, now=0.0)
    registry.observe("b", 0.0, RULE, now=0.0)
    assert registry.observe("a", 7.0, RULE, now=1.0).active is True
    assert registry.observe("b", 7.0, RULE, now=1.0).active is False
    assert len(registry) == 2


@pytest.mark.parametrize(
    ("keep", "remaining"),
    [
        pytest.param(set(), {"recent"}, id="nothing-kept"),
        pytest.param({"old"}, {"old", "recent"}, id="open-stream-kept"),
        pytest.param({"old", "older"}, {"old", "older", "recent"}, id="both-kept"),
        pytest.param({"unknown"}, {"recent"}, id="keeping-an-unknown-key"),
    ],
)
def test_forget_idle_drops_unused_states_except_those_kept(keep: set[Hashable], remaining: set[str]) -> None:
    """States unused for idle_seconds are forgotten, unless an open stream keeps them."""
    registry = ActivationStates(idle_seconds=100.0)
    registry.observe("older", 20.0, RULE, now=0.0)
    registry.observe("old", 20.0, RULE, now=40.0)
    registry.observe("recent", 20.0, RULE, now=140.0)
    registry.forget_idle(now=145.0, keep=keep)
    assert len(registry) == len(remaining)
    for key in ("older", "old", "recent"):
        # A forgotten key starts over at first sight; a kept one remembers it was active.
        transition = registry.observe(key, 7.0, RULE, now=146.0)
        assert transition.first is (key not in remaining)
        assert transition.active is (key in remaining)


def test_using_a_state_keeps_it_alive() -> None:
    """Each observation refreshes the idle clock, so a query KEDA polls is never forgotten."""
    registry = ActivationStates(idle_seconds=100.0)
    for now in (0.0, 90.0, 180.0):
        registry.observe("polled", 20.0, RULE, now=now)
        registry.forget_idle(now=now + 50.0, keep=set())
    assert len(registry) == 1
    registry.forget_idle(now=281.0, keep=set())
    assert len(registry) == 0


def test_peek_answers_as_observe_would_and_keeps_nothing() -> None:
    """peek() gives the state a value would lead to, from the kept one, and keeps nothing."""
    registry = ActivationStates(idle_seconds=100.0)
    assert registry.peek("q", 20.0, RULE) is True  # first sight
    assert len(registry) == 0
    registry.observe("q", 20.0, RULE, now=0.0)
    assert registry.peek("q", 7.0, RULE) is True  # between the thresholds: stays active
    assert registry.peek("q", 3.0, RULE) is False
    assert registry.observe("q", 7.0, RULE, now=50.0).changed is False  # peeking at 3 moved nothing
