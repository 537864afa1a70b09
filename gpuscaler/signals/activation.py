"""Activation with hysteresis, kept per query so that polls and streams agree on the state.

KEDA applies no activationThreshold to external triggers; IsActive's answer is the whole decision.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from gpuscaler.query.query import ActivationRule


def next_state(previous: bool | None, value: float, rule: ActivationRule) -> bool:
    """The activation state after seeing ``value``; ``previous`` None means first sight."""
    if previous is None:
        return value > rule.activation_threshold
    if previous:
        return value > rule.deactivation_threshold
    return value > rule.activation_threshold


@dataclass(slots=True)
class _Entry:
    active: bool
    last_used: float


@dataclass(frozen=True, slots=True)
class Transition:
    """What ``ActivationStates.observe`` saw: the state now, and whether it just changed."""

    active: bool
    changed: bool
    first: bool


class ActivationStates:
    """Hysteresis states keyed by query, forgotten after ``idle_seconds`` without use."""

    def __init__(self, *, idle_seconds: float) -> None:
        self._idle_seconds = idle_seconds
        self._entries: dict[Hashable, _Entry] = {}

    def observe(self, key: Hashable, value: float, rule: ActivationRule, *, now: float) -> Transition:
        entry = self._entries.get(key)
        active = next_state(entry.active if entry else None, value, rule)
        if entry is None:
            self._entries[key] = _Entry(active, now)
            return Transition(active, changed=False, first=True)
        changed = active != entry.active
        entry.active = active
        entry.last_used = now
        return Transition(active, changed=changed, first=False)

    def peek(self, key: Hashable, value: float, rule: ActivationRule) -> bool:
        """The state ``observe`` would give for ``value``, without keeping it or touching the entry's use."""
        entry = self._entries.get(key)
        return next_state(entry.active if entry else None, value, rule)

    def forget_idle(self, *, now: float, keep: set[Hashable]) -> None:
        """Drop states not used for ``idle_seconds``, except those in ``keep`` (open streams)."""
        cutoff = now - self._idle_seconds
        for key in [k for k, e in self._entries.items() if e.last_used < cutoff and k not in keep]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
