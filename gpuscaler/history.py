"""The ring buffer of snapshots that every handler reads from, and the wake-up for those who wait on it."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Iterator

from gpuscaler.samples import Snapshot


class History:
    """The newest snapshots, oldest first, bounded by ``history_seconds / poll_interval_seconds``.

    Only the poll loop appends; readers never block it. Waiters wake once per appended snapshot.
    """

    def __init__(self, *, history_seconds: float, poll_interval_seconds: float) -> None:
        self.history_seconds = history_seconds
        self.poll_interval_seconds = poll_interval_seconds
        self._snapshots: deque[Snapshot] = deque(maxlen=math.ceil(history_seconds / poll_interval_seconds) + 1)
        self._appended = asyncio.Event()

    def append(self, snapshot: Snapshot) -> None:
        self._snapshots.append(snapshot)
        # Swap the event so waiters that re-wait do not see this tick's set() again.
        appended, self._appended = self._appended, asyncio.Event()
        appended.set()

    @property
    def latest(self) -> Snapshot | None:
        return self._snapshots[-1] if self._snapshots else None

    def __len__(self) -> int:
        return len(self._snapshots)

    def window(self, seconds: float) -> list[Snapshot]:
        """Snapshots no older than ``seconds`` before the latest one, oldest first."""
        latest = self.latest
        if latest is None:
            return []
        start = latest.monotonic - seconds
        newest_first: list[Snapshot] = []
        for snapshot in reversed(self._snapshots):
            if snapshot.monotonic < start:
                break
            newest_first.append(snapshot)
        newest_first.reverse()
        return newest_first

    def newest_first(self) -> Iterator[Snapshot]:
        return reversed(self._snapshots)

    def window_for(self, node: str, seconds: float) -> list[Snapshot]:
        """``node``'s snapshots in the window. An agent's history is its own node's; a gateway's overrides this."""
        return self.window(seconds)

    def newest_first_for(self, node: str) -> Iterator[Snapshot]:
        """``node``'s snapshots, newest first (see ``window_for``)."""
        return self.newest_first()

    async def wait_newer(self, sequence: int) -> Snapshot:
        """The latest snapshot once its sequence is above ``sequence``."""
        while True:
            latest = self.latest
            if latest is not None and latest.sequence > sequence:
                return latest
            await self._appended.wait()
