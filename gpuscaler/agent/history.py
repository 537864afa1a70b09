"""The agent's ring buffer of its node's snapshots: the ``SnapshotSource`` every handler reads from.

Windows are reduced here, from the ring buffer: each GPU's readable values in the window, oldest first,
through ``aggregation.reduce_window``. The series are split once per (newest snapshot, window length), so
a window costs one pass over the buffer however many GPUs and queries ask for it. A rate's window is the
counter's increase over it (``rates.py``); on a GPU several pods hold, each pod's own share is reduced too.
Each says how much of its length its readings cover: the buffer starts empty when the agent starts.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import deque
from collections.abc import Iterator

from gpuscaler.agent.rates import counter_rate
from gpuscaler.model.aggregation import reduce_window
from gpuscaler.model.gpu_metrics import METRICS
from gpuscaler.model.pods import uid_key
from gpuscaler.model.samples import GpuSample, Snapshot
from gpuscaler.model.windows import Windowed, WindowKey, covered
from gpuscaler.signals.per_snapshot import PerSnapshot
from gpuscaler.signals.shares import holders, pod_share
from gpuscaler.signals.source import AnnouncedSource


class History(AnnouncedSource):
    """The newest snapshots, oldest first, bounded by ``history_seconds / poll_interval_seconds``.

    Only the poll loop appends; readers never block it. Each append is announced once.
    """

    def __init__(self, *, history_seconds: float, poll_interval_seconds: float) -> None:
        super().__init__(history_seconds=history_seconds, interval_seconds=poll_interval_seconds)
        self._snapshots: deque[Snapshot] = deque(maxlen=math.ceil(history_seconds / poll_interval_seconds) + 1)
        # Each window's series of GPU samples, per node, of the newest snapshot.
        self._series = PerSnapshot[float, dict[str, tuple[list[float], list[GpuSample]]]]()
        self._keep = True  # False in a read's copy (``for_read``)

    def for_read(self) -> History:
        """This history for a read path: the same snapshots, and the series KEDA's calls split for the newest
        one, but a series it splits for a window length no one else asked for is its own, not kept."""
        reading = copy.copy(self)
        reading._keep = False
        return reading

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

    def windowed(self, sample: GpuSample, window: WindowKey) -> Windowed:
        times, series = self._series_of(sample.node, window.seconds).get(sample.gpu.uuid, ((), ()))
        info = METRICS[window.metric]
        if info.rate:
            readings = [getattr(other, info.reading) for other in series]
            rate = counter_rate(window.metric, list(zip(times, readings, strict=True)))
            first = rate.first_seconds if rate.value is not None else None
            return Windowed(rate.value, rate.sample_count, rate.reason, covered_seconds=self._covered(window, first))
        values = [value for other in series if (value := other.value(window.metric)) is not None]
        # The oldest readable sample is nearly always the window's first: found at once.
        first = next(
            (t for t, other in zip(times, series, strict=True) if other.value(window.metric) is not None), None
        )
        reduced = Windowed(
            reduce_window(window.function, values) if values else None,
            len(values),
            covered_seconds=self._covered(window, first),
        )
        if info.per_process is None or holders(sample) < 2 or not sample.processes:
            return reduced
        shares = {}  # each pod's own share over the window, for a gateway that knows the pods' UIDs
        for uid in {process.pod_uid for process in sample.processes if process.pod_uid}:
            # ticks without per-process figures are left out of the pod's window, as unread values are
            own = [
                (t, v)
                for t, other in zip(times, series, strict=True)
                if (v := pod_share(other, window.metric, uid)) is not None
            ]
            shares[uid_key(uid)] = (
                Windowed(
                    reduce_window(window.function, [v for _, v in own]),
                    len(own),
                    covered_seconds=self._covered(window, own[0][0]),
                )
                if own
                else Windowed(None, 0)
            )
        return reduced._replace(shares=shares)

    def _covered(self, window: WindowKey, first: float | None) -> float | None:
        """How much of ``window`` readings from ``first`` (a tick time) to the newest tick cover (``covered``)."""
        latest = self.latest
        if first is None or latest is None:
            return None
        return covered(
            first,
            latest.taken_at,
            window_seconds=window.seconds,
            interval_seconds=self._interval_seconds,
            reading_covers_interval=METRICS[window.metric].reading_covers_interval,
        )

    def _series_of(self, node: str, seconds: float) -> dict[str, tuple[list[float], list[GpuSample]]]:
        """Each GPU's samples in the window, with their tick times, oldest first; ``seconds`` 0: the newest two."""
        latest = self.latest
        sequence = latest.sequence if latest is not None else -1
        series = (self._series.at(sequence) if self._keep else self._series.kept(sequence)).get(seconds)
        if series is None:
            series = {}
            if self._keep:
                self._series.at(sequence)[seconds] = series
            snapshots = (
                self.window(node, seconds) if seconds else list(itertools.islice(self.newest_first(node), 2))[::-1]
            )
            for snapshot in snapshots:
                for other in snapshot.samples:
                    times, samples = series.setdefault(other.gpu.uuid, ([], []))
                    times.append(snapshot.taken_at)
                    samples.append(other)
        return series

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        latest = self.latest
        return reversed(self._snapshots) if latest is not None and latest.node == node else iter(())
