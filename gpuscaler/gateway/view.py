"""The gateway's cluster view: each agent's newest snapshots, composed into one cluster snapshot.

Every node keeps its own ring buffer (windows are per GPU, so per node). On each agent update, after a
short coalescing delay, the view composes one cluster ``Snapshot`` from the newest snapshot of every
fresh node and appends it, which wakes the engine (push streams) within one agent tick. A timer
composes too, so a node that stops sending leaves the view after its staleness bound even when no
other node sends anything. Freshness is judged on the gateway's own clock at arrival, because the
agents' clocks are not ours.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from gpuscaler.history import History
from gpuscaler.samples import Snapshot
from gpuscaler.source import Announcer, SnapshotListener, stale_after_for

log = structlog.get_logger(__name__)

CLUSTER_NODE = "cluster"
DEFAULT_COMPOSE_INTERVAL_SECONDS = 0.5
DEFAULT_COALESCE_SECONDS = 0.02
# A node unseen this long is forgotten altogether (its history freed); until then it only leaves the view.
FORGET_AFTER_SECONDS = 15 * 60.0


@dataclass(slots=True)
class _Node:
    history: History
    stale_after: float
    latest: Snapshot

    def fresh(self, now: float) -> bool:
        return now - self.latest.monotonic <= self.stale_after


class ClusterView:
    """The ``SnapshotSource`` of a gateway: composed cluster snapshots, and windows from each node's own history."""

    def __init__(
        self,
        *,
        history_seconds: float,
        compose_interval_seconds: float = DEFAULT_COMPOSE_INTERVAL_SECONDS,
        coalesce_seconds: float = DEFAULT_COALESCE_SECONDS,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._history_seconds = history_seconds
        self._interval_seconds = compose_interval_seconds
        self._clock = clock or asyncio.get_running_loop().time
        self._coalesce = coalesce_seconds
        self._nodes: dict[str, _Node] = {}
        self._announcer = Announcer()
        self._latest: Snapshot | None = None
        self._sequence = 0
        self._pending: asyncio.TimerHandle | None = None
        self._fresh_names: tuple[str, ...] = ()
        self.expected_nodes = 0
        self.updates = 0

    @property
    def history_seconds(self) -> float:
        return self._history_seconds

    @property
    def interval_seconds(self) -> float:
        return self._interval_seconds

    @property
    def stale_after(self) -> float:
        return stale_after_for(self._interval_seconds)

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def add_listener(self, listener: SnapshotListener) -> None:
        self._announcer.add_listener(listener)

    async def wait_newer(self, sequence: int) -> Snapshot:
        while True:
            latest = self._latest
            if latest is not None and latest.sequence > sequence:
                return latest
            await self._announcer.wait()

    def update(self, snapshot: Snapshot, *, poll_interval_seconds: float) -> None:
        """An agent's snapshot, stamped with the gateway's clock; composes the view shortly after."""
        self.updates += 1
        node = self._nodes.get(snapshot.node)
        stale_after = stale_after_for(poll_interval_seconds)
        if node is None or node.history.interval_seconds != poll_interval_seconds:
            history = History(history_seconds=self._history_seconds, poll_interval_seconds=poll_interval_seconds)
            node = self._nodes[snapshot.node] = _Node(history, stale_after, snapshot)
        node.history.append(snapshot)
        node.latest = snapshot
        node.stale_after = stale_after
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self._coalesce, self._compose_pending)

    def _compose_pending(self) -> None:
        self._pending = None
        self.compose()

    def compose(self) -> Snapshot:
        """Append and announce the cluster snapshot of every fresh node, as of now."""
        now = self._clock()
        for name in [n for n, node in self._nodes.items() if now - node.latest.monotonic > FORGET_AFTER_SECONDS]:
            del self._nodes[name]
        fresh = sorted((node for node in self._nodes.values() if node.fresh(now)), key=lambda n: n.latest.node)
        parts = tuple(node.latest for node in fresh)
        self._sequence += 1
        snapshot = Snapshot(
            sequence=self._sequence,
            taken_at=time.time(),
            monotonic=now,
            node=CLUSTER_NODE,
            samples=tuple(sample for part in parts for sample in part.samples),
            parts=parts,
            expected_nodes=max(self.expected_nodes, len(parts)),
        )
        self._log_changes(snapshot, now)
        self._latest = snapshot
        self._announcer.announce(snapshot)
        return snapshot

    def _log_changes(self, snapshot: Snapshot, now: float) -> None:
        names = tuple(part.node for part in snapshot.parts)
        if names == self._fresh_names:
            return
        joined = sorted(set(names) - set(self._fresh_names))
        left = sorted(set(self._fresh_names) - set(names))
        self._fresh_names = names
        ages = [round(now - self._nodes[name].latest.monotonic, 1) for name in left if name in self._nodes]
        (log.warning if left else log.info)(
            "view_changed",
            nodes=len(names),
            nodes_expected=snapshot.expected_nodes,
            gpus=len(snapshot.samples),
            joined=joined,
            left=left,
            left_after_seconds=ages,
        )

    @property
    def nodes(self) -> dict[str, Snapshot]:
        """Every node's newest snapshot, fresh or not (until forgotten)."""
        return {name: node.latest for name, node in self._nodes.items()}

    def window(self, node: str, seconds: float) -> list[Snapshot]:
        entry = self._nodes.get(node)
        return entry.history.window(node, seconds) if entry is not None else []

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        entry = self._nodes.get(node)
        return entry.history.newest_first(node) if entry is not None else iter(())

    async def run(self) -> None:
        """Compose on a timer too, so stale nodes leave the view while nobody sends; until cancelled."""
        try:
            while True:
                await asyncio.sleep(self._interval_seconds)
                self.compose()
        finally:
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None
