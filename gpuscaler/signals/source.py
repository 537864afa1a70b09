"""Where the evaluator reads snapshots from: one protocol for the agent's ring buffer and the gateway's cluster view.

A source holds the newest snapshot, each GPU's value over a window (the agent from its own ring buffer, the
gateway from what each agent computed for it), the age at which its newest snapshot is no longer an answer,
and the one way a new snapshot is announced: listeners called in order, and ``wait_newer`` for those who
wait (the snapshot streams).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import structlog

from gpuscaler.model.columns import WindowColumn
from gpuscaler.model.samples import GpuSample, Snapshot
from gpuscaler.model.staleness import snapshot_stale_after
from gpuscaler.model.windows import Windowed, WindowKey

log = structlog.get_logger(__name__)

SnapshotListener = Callable[[Snapshot], None]


class SnapshotSource(Protocol):
    """The snapshots an evaluator answers from."""

    @property
    def cluster(self) -> bool:
        """True for a gateway's view, whose snapshots are composed clusters: the one place that says so. The
        evaluator's limits, its node memo and every branch of an evaluation on where it runs read it here."""

    @property
    def history_seconds(self) -> float:
        """How far back a window may reach."""

    @property
    def interval_seconds(self) -> float:
        """How often a new snapshot comes: the agent's poll interval, the gateway's compose timer."""

    @property
    def stale_after(self) -> float:
        """The newest snapshot older than this many seconds is not an answer."""

    @property
    def latest(self) -> Snapshot | None:
        """The newest snapshot: a node's on an agent, the composed cluster's on the gateway."""

    def windowed(self, sample: GpuSample, window: WindowKey) -> Windowed:
        """``sample``'s GPU over ``window``, ending at its node's newest snapshot.

        Raises Unavailable when the source cannot tell yet (a gateway whose agents have not computed it).
        """

    def window_column(self, part: Snapshot, window: WindowKey) -> WindowColumn:
        """``windowed``'s value, sample count and coverage for each of node snapshot ``part``'s GPUs, in order.

        A gateway reads them as a column of its agent's snapshot; raises as ``windowed`` does.
        """

    def request(self, windows: Iterable[WindowKey]) -> None:
        """Keep ``windows`` answerable from now on: a gateway asks its agents for them (Unsupported past
        MAX_WINDOWS); an agent has them all. Reading a window never asks for it."""

    async def prepare(self, windows: Sequence[WindowKey]) -> None:
        """``request`` them, and wait a little where that takes a round trip (a gateway's agents)."""

    def windows_for_read(
        self, windows: Sequence[WindowKey], *, time_left: float | None = None
    ) -> AbstractAsyncContextManager[None]:
        """``windows`` answerable for a read inside the ``async with`` only, leaving nothing asked afterwards: a
        gateway asks its agents for those no KEDA call uses until the read leaves (within ``time_left``, seconds
        of the caller's deadline) and moves no window's last use; an agent computes every window itself."""

    def for_read(self) -> SnapshotSource:
        """This source as a read path (Explain, a preview) evaluates over: the same answers, using what KEDA's
        calls kept for the newest snapshot but keeping nothing it computes (an agent's split series)."""

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        """``node``'s snapshots, newest first."""

    def add_listener(self, listener: SnapshotListener) -> None:
        """Call ``listener`` with every new snapshot, after it became ``latest``."""

    async def wait_newer(self, sequence: int) -> Snapshot:
        """The latest snapshot once its sequence is above ``sequence``."""


def window_column(
    windowed: Callable[[GpuSample, WindowKey], Windowed], part: Snapshot, window: WindowKey
) -> WindowColumn:
    """``window_column`` as any source can answer it: through its ``windowed``, GPU by GPU."""
    each = [windowed(sample, window) for sample in part.samples]
    covered = [w.covered_seconds for w in each]
    return (
        [w.value for w in each],
        [w.sample_count for w in each],
        covered if any(seconds is not None for seconds in covered) else None,
    )


class Announcer:
    """The announcement half of a source: listeners in order, and a wake-up for waiters."""

    def __init__(self) -> None:
        self._listeners: list[SnapshotListener] = []
        self._announced = asyncio.Event()

    def add_listener(self, listener: SnapshotListener) -> None:
        self._listeners.append(listener)

    def announce(self, snapshot: Snapshot) -> None:
        # Swap the event so waiters that re-wait do not see this snapshot's set() again.
        announced, self._announced = self._announced, asyncio.Event()
        announced.set()
        for listener in self._listeners:
            try:
                listener(snapshot)
            except Exception:  # a listener's bug must not stop the snapshots
                log.exception("snapshot_listener_failed", listener=getattr(listener, "__qualname__", listener))

    async def wait(self) -> None:
        """Until the next announcement."""
        await self._announced.wait()


class AnnouncedSource:
    """What every source does alike: its timing, its listeners and its waiters, over its own ``latest``."""

    cluster = False  # a gateway's view says True

    def __init__(self, *, history_seconds: float, interval_seconds: float) -> None:
        self._history_seconds = history_seconds
        self._interval_seconds = interval_seconds
        self._announcer = Announcer()

    @property
    def history_seconds(self) -> float:
        return self._history_seconds

    @property
    def interval_seconds(self) -> float:
        return self._interval_seconds

    @property
    def stale_after(self) -> float:
        return snapshot_stale_after(self._interval_seconds)

    @property
    def latest(self) -> Snapshot | None:
        raise NotImplementedError

    def windowed(self, sample: GpuSample, window: WindowKey) -> Windowed:
        raise NotImplementedError

    def window_column(self, part: Snapshot, window: WindowKey) -> WindowColumn:
        return window_column(self.windowed, part, window)

    def request(self, windows: Iterable[WindowKey]) -> None:
        return None

    async def prepare(self, windows: Sequence[WindowKey]) -> None:
        return None

    @contextlib.asynccontextmanager
    async def windows_for_read(
        self, windows: Sequence[WindowKey], *, time_left: float | None = None
    ) -> AsyncIterator[None]:
        yield  # a node's own history answers every window: nothing to ask, nothing to let go

    def add_listener(self, listener: SnapshotListener) -> None:
        self._announcer.add_listener(listener)

    async def wait_newer(self, sequence: int) -> Snapshot:
        while True:
            latest = self.latest
            if latest is not None and latest.sequence > sequence:
                return latest
            await self._announcer.wait()
