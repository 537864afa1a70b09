"""Energy while idle: what a GPU's board used in the poll intervals in which it ran nothing.

The definition, once. An *interval* is the time between two consecutive samples of one GPU (one poll
interval, 0.5 s by default). Its *energy* is the increase of the GPU's energy counter between the two
samples. It is *idle* when the closing sample's ``gpu_utilization`` is 0: NVML's duty cycle saw no kernel
run in its sample period (1/6 s to 1 s, which covers the interval at the default poll). An interval whose
energy or utilisation is unknown (a reading absent, the counter restarted) counts in neither sum: its
seconds are reported as unknown, never as idle and never as 0 J.

*Energy while idle* of a set of GPUs is the sum over their idle intervals, each GPU once: a GPU two pods
share is wasted for both, but counts once per workload. Idle power is what a GPU costs with nothing to do
(60-100 W for a data-centre GPU), which is the waste autoscaling to zero removes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from gpuscaler.samples import GpuSample, Snapshot, column, uuids

# How long a pod's or workload's counter is kept after its last interval, so that rate() spans a pause.
FORGET_AFTER_SECONDS = 3600.0


class Interval(NamedTuple):
    """One GPU's energy between two of its samples, and whether it ran nothing meanwhile; None fields: unknown.

    A named tuple: a gateway makes one per GPU per snapshot, thousands a second.
    """

    seconds: float
    joules: float | None
    idle: bool | None


def interval(before: GpuSample, before_at: float, after: GpuSample, after_at: float) -> Interval:
    """The interval between two samples of one GPU taken at ``before_at`` and ``after_at`` (seconds)."""
    return interval_between(
        max(0.0, after_at - before_at), before.energy_joules, after.energy_joules, after.gpu_utilization_percent
    )


def interval_between(seconds: float, start: float | None, end: float | None, utilization: float | None) -> Interval:
    """An interval of ``seconds`` from the energy counter at ``start`` to ``end``, closing at ``utilization``."""
    if start is None or end is None or end < start:
        return Interval(seconds, None, None)
    return Interval(seconds, end - start, None if utilization is None else utilization == 0.0)


@dataclass(frozen=True, slots=True)
class IdleEnergy:
    """Energy while idle and while busy over ``seconds`` on ``gpus`` GPUs; ``unknown_seconds`` were neither."""

    idle_joules: float
    busy_joules: float
    seconds: float
    unknown_seconds: float
    gpus: int

    @property
    def idle_share(self) -> float | None:
        """Idle joules over all known joules, 0-1; None when nothing was known."""
        total = self.idle_joules + self.busy_joules
        return None if total <= 0 else self.idle_joules / total


class NodeHistory(Protocol):
    """A history of each node's snapshots (the agent's ring buffer)."""

    @property
    def history_seconds(self) -> float: ...

    def window(self, node: str, seconds: float) -> Sequence[Snapshot]: ...


def idle_energy(source: NodeHistory, samples: Iterable[GpuSample], window_seconds: float | None) -> IdleEnergy:
    """Energy while idle of ``samples``' GPUs (each once) over the window, or over all the history ``source`` keeps."""
    seconds = window_seconds if window_seconds is not None else source.history_seconds
    idle = busy = unknown = covered = 0.0
    gpus = 0
    for node, uuid in sorted({(sample.node, sample.gpu.uuid) for sample in samples}):
        series = [
            (snapshot.taken_at, other)
            for snapshot in source.window(node, seconds)
            for other in snapshot.samples
            if other.gpu.uuid == uuid
        ]
        gpus += 1
        for (before_at, before), (after_at, after) in itertools.pairwise(series):
            part = interval(before, before_at, after, after_at)
            covered = max(covered, after_at - series[0][0])
            if part.joules is None or part.idle is None:
                unknown += part.seconds
            elif part.idle:
                idle += part.joules
            else:
                busy += part.joules
    return IdleEnergy(idle, busy, covered, unknown, gpus)


@dataclass(slots=True)
class _Total:
    joules: float = 0.0  # while idle
    last_seen: float = -math.inf
    busy_joules: float = 0.0
    unknown_seconds: float = 0.0
    first_at: float | None = None  # the tick time of the first sample counted


_Seen = tuple[float, float | None, Sequence[GpuSample], int, _Total]


@dataclass
class IdleEnergyCounter:
    """Counts energy while idle as snapshots arrive: per GPU, and per owner of the GPU (a pod, a workload).

    ``owners`` turns a sample into the owners its idle energy counts for (each once): on an agent the pods
    the kubelet assigned the GPU to, at the gateway their workloads.
    """

    owners: Callable[[GpuSample], Iterable[tuple[str, str]]]
    gpus: dict[tuple[str, str], _Total] = field(default_factory=dict)  # (node, uuid)
    by_owner: dict[tuple[str, str], _Total] = field(default_factory=dict)
    # Each node's GPUs' newest samples, by node first: a gateway counts thousands of nodes, each on its own.
    # (tick time, energy counter, the snapshot's samples, the GPU's place in them: its record made if read,
    # and its entry in ``gpus``, so that a tick looks it up once)
    _last: dict[str, dict[str, _Seen]] = field(default_factory=dict)
    _next_expiry: float = -math.inf

    def observe(self, snapshot: Snapshot) -> None:
        """Count one node's snapshot: each GPU's interval since its previous sample.

        It reads the snapshot's columns (a gateway counts thousands of nodes a second), and a GPU's record
        only where an idle interval needs its owners.
        """
        now = snapshot.monotonic
        node = snapshot.node
        at = snapshot.taken_at
        last = self._last.setdefault(node, {})
        samples = snapshot.samples
        present = uuids(samples)
        energies = column(samples, "energy_joules")
        utilizations = column(samples, "gpu_utilization_percent")
        for index, uuid in enumerate(present):
            energy = energies[index]
            previous = last.get(uuid)
            if previous is None:
                total = self.gpus.get((node, uuid))
                if total is None:
                    total = self.gpus[(node, uuid)] = _Total()
                last[uuid] = (at, energy, samples, index, total)
                total.last_seen = now
                total.first_at = at
                continue
            total = previous[4]
            last[uuid] = (at, energy, samples, index, total)
            total.last_seen = now
            part = interval_between(max(0.0, at - previous[0]), previous[1], energy, utilizations[index])
            if part.joules is None or part.idle is None:
                total.unknown_seconds += part.seconds
                continue
            if not part.idle:
                total.busy_joules += part.joules
                continue
            total.joules += part.joules
            for owner in set(self.owners(samples[index])):
                owned = self.by_owner.get(owner)
                if owned is None:
                    owned = self.by_owner[owner] = _Total()
                owned.joules += part.joules
                owned.last_seen = now
        if len(last) > len(present):
            kept = set(present)
            for uuid in [u for u in last if u not in kept]:
                del last[uuid]  # the GPU left its node: its series ends with it
                self.gpus.pop((node, uuid), None)
        if now >= self._next_expiry:  # owners are few and expire slowly: a sweep a minute is enough
            self._next_expiry = now + 60.0
            for owner in [o for o, t in self.by_owner.items() if now - t.last_seen > FORGET_AFTER_SECONDS]:
                del self.by_owner[owner]

    def gpu_totals(self) -> list[tuple[GpuSample, float]]:
        """Each GPU still present, by its newest sample, with its energy while idle so far."""
        return [
            (self._last[node][uuid][2][self._last[node][uuid][3]], total.joules)
            for (node, uuid), total in sorted(self.gpus.items())
            if uuid in self._last.get(node, {})
        ]

    def summary(self, samples: Iterable[GpuSample]) -> IdleEnergy:
        """Energy while idle of ``samples``' GPUs (each once), over all this counter has seen of them."""
        idle = busy = unknown = covered = 0.0
        gpus = 0
        for node, uuid in sorted({(sample.node, sample.gpu.uuid) for sample in samples}):
            total, last = self.gpus.get((node, uuid)), self._last.get(node, {}).get(uuid)
            if total is None or last is None or total.first_at is None:
                continue
            gpus += 1
            idle += total.joules
            busy += total.busy_joules
            unknown += total.unknown_seconds
            covered = max(covered, last[0] - total.first_at)
        return IdleEnergy(idle, busy, covered, unknown, gpus)

    def forget_node(self, node: str) -> None:
        """A node that left (its agent left discovery) takes its GPUs' counters with it."""
        for uuid in self._last.pop(node, {}):
            self.gpus.pop((node, uuid), None)


def pods_of(sample: GpuSample) -> set[tuple[str, str]]:
    """The (namespace, pod) pairs that hold ``sample``'s GPU."""
    return {(ref.namespace, ref.pod) for ref in sample.pods}
