"""When a periodic reading stops counting: three missed intervals, with a floor, for every reader of one.

A snapshot (the agent's poll, the gateway's view of a node) and the kubelet's pod assignment are each refreshed
on an interval; a reading counts as fresh until three refreshes have been missed, so one late tick on a busy
node is not an outage. The floors differ because the costs do: a stale snapshot must turn answers UNAVAILABLE
within seconds, while a kubelet that misses a beat keeps its last assignment a little longer, as pods rarely
move in 5 s and dropping them would make every pod query fail at once.
"""

from __future__ import annotations

MISSED_INTERVALS = 3
SNAPSHOT_FLOOR_SECONDS = 2.0
ASSIGNMENT_FLOOR_SECONDS = 5.0


def snapshot_stale_after(interval_seconds: float) -> float:
    """How old a snapshot taken every ``interval_seconds`` may be and still be fresh."""
    return max(MISSED_INTERVALS * interval_seconds, SNAPSHOT_FLOOR_SECONDS)


def assignment_stale_after(interval_seconds: float) -> float:
    """How long the kubelet's last pod assignment, read every ``interval_seconds``, is kept after reads fail."""
    return max(MISSED_INTERVALS * interval_seconds, ASSIGNMENT_FLOOR_SECONDS)
