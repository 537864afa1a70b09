"""The agent's ring buffer of its node's snapshots: the ``SnapshotSource`` every handler reads from."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from gpuscaler.samples import Snapshot
from gpuscaler.source import AnnouncedSource


class History(AnnouncedSource):
    """The newest snapshots, oldest first, bounded by ``history_seconds / poll_interval_seconds``.

    Only the poll loop appends; readers never block it. Each append is announced once.
    """

    def __init__(self, *, history_seconds: float, poll_interval_seconds: float) -> None:
        super().__init__(history_seconds=history_seconds, interval_seconds=poll_interval_seconds)
        self._snapshots: deque[Snapshot] = deque(maxlen=math.ceil(history_seconds / poll_interval_seconds) + 1)

    def append(self, snapshot: Snapshot) -> None:
        self._snapshots.append(snapshot)
        self._announcer.announce(snapshot)

    @property
    def latest(self) -> Snapshot | None:
        return self._snapshots[-1] if self._snapshots else None

    def __len__(self) -> int:
        return len(self._snapshots)

    def window(self, node: str, seconds: float) -> list[Snapshot]:
        """``node``'s snapshots no older than ``seconds`` before the latest, oldest first (none of another node)."""
        latest = self.latest
        if latest is None or latest.node != node:
            return []
        start = latest.monotonic - seconds
        newest_first: list[Snapshot] = []
        for snapshot in reversed(self._snapshots):
            if snapshot.monotonic < start:
                break
            newest_first.append(snapshot)
        newest_first.reverse()
        return newest_first

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        latest = self.latest
        return reversed(self._snapshots) if latest is not None and latest.node == node else iter(())
