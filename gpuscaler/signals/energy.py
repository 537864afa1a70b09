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
from operator import ge, sub
from typing import NamedTuple, Protocol, cast

from gpuscaler.model.columns import column, uuids
from gpuscaler.model.samples import GpuKey, GpuSample, Snapshot

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


def idle_energy(source: NodeHistory, gpus: Iterable[GpuKey], window_seconds: float | None) -> IdleEnergy:
    """Energy while idle of ``gpus`` (each once) over the window, or over all the history ``source`` keeps."""
    seconds = window_seconds if window_seconds is not None else source.history_seconds
    idle = busy = unknown = covered = 0.0
    counted = 0
    for node, uuid in sorted(set(gpus)):
        series = [
            (snapshot.taken_at, other)
            for snapshot in source.window(node, seconds)
            for other in snapshot.samples
            if other.gpu.uuid == uuid
        ]
        counted += 1
        for (before_at, before), (after_at, after) in itertools.pairwise(series):
            part = interval(before, before_at, after, after_at)
            covered = max(covered, after_at - series[0][0])
            if part.joules is None or part.idle is None:
                unknown += part.seconds
            elif part.idle:
                idle += part.joules
            else:
                busy += part.joules
    return IdleEnergy(idle, busy, covered, unknown, counted)


@dataclass(slots=True)
class _Total:
    """One GPU's (or one owner's) energy so far: while idle, while busy, and the time neither could be told."""

    idle_joules: float = 0.0
    last_seen: float = -math.inf
    busy_joules: float = 0.0
    unknown_seconds: float = 0.0
    first_at: float | None = None  # the tick time of the first sample counted


@dataclass(slots=True)
class _NodeSeen:
    """A node's newest snapshot as counted: its tick time, its GPUs' UUIDs and energy counters in order, its
    samples (a GPU's record is made only if read), and each GPU's entry in ``IdleEnergyCounter.gpus``."""

    at: float
    uuids: list[str]
    energies: Sequence[float | None]
    samples: Sequence[GpuSample]
    totals: list[_Total]


@dataclass
class IdleEnergyCounter:
    """Counts energy while idle as snapshots arrive: per GPU, and per owner of the GPU (a pod, a workload).

    ``owners`` turns a sample into the owners its idle energy counts for (each once): on an agent the pods
    the kubelet assigned the GPU to, at the gateway their workloads.
    """

    owners: Callable[[GpuSample], Iterable[tuple[str, str]]]
    gpus: dict[tuple[str, str], _Total] = field(default_factory=dict)  # (node, uuid)
    by_owner: dict[tuple[str, str], _Total] = field(default_factory=dict)
    _last: dict[str, _NodeSeen] = field(default_factory=dict)  # by node: a gateway counts thousands of nodes
    _next_expiry: float = -math.inf

    def observe(self, snapshot: Snapshot) -> None:
        """Count one node's snapshot: each GPU's interval since its previous sample.

        It reads the snapshot's columns (a gateway counts thousands of nodes a second), and a GPU's record
        only where an idle interval needs its owners. The common tick (the same GPUs, each busy, every
        counter known and rising) is counted column by column.
        """
        now = snapshot.monotonic
        node = snapshot.node
        at = snapshot.taken_at
        samples = snapshot.samples
        present = uuids(samples)
        energies = column(samples, "energy_joules")
        utilizations = column(samples, "gpu_utilization_percent")
        previous = self._last.get(node)
        if previous is not None and previous.uuids == present:
            totals = previous.totals
            before = previous.energies
            if (
                None not in energies
                and None not in before
                and None not in utilizations
                and 0.0 not in utilizations
                and all(map(ge, cast(Sequence[float], energies), cast(Sequence[float], before)))
            ):
                joules_each = map(sub, cast(Sequence[float], energies), cast(Sequence[float], before))
                for total, joules in zip(totals, joules_each, strict=True):
                    total.busy_joules += joules
                    total.last_seen = now
            else:
                seconds = max(0.0, at - previous.at)
                for index, total in enumerate(totals):
                    total.last_seen = now
                    self._count(total, seconds, before[index], energies[index], utilizations[index], samples, index)
        else:
            totals = self._match(node, present, energies, utilizations, samples, at, now, previous)
        self._last[node] = _NodeSeen(at, present, energies, samples, totals)
        if now >= self._next_expiry:  # owners are few and expire slowly: a sweep a minute is enough
            self._next_expiry = now + 60.0
            for owner in [o for o, t in self.by_owner.items() if now - t.last_seen > FORGET_AFTER_SECONDS]:
                del self.by_owner[owner]

    def _match(
        self,
        node: str,
        present: list[str],
        energies: Sequence[float | None],
        utilizations: Sequence[float | None],
        samples: Sequence[GpuSample],
        at: float,
        now: float,
        previous: _NodeSeen | None,
    ) -> list[_Total]:
        """A node seen first, or whose GPUs changed: each GPU by its UUID; one that left ends its series."""
        earlier: dict[str, tuple[float | None, _Total]] = {}
        if previous is not None:
            earlier = dict(zip(previous.uuids, zip(previous.energies, previous.totals, strict=True), strict=True))
        seconds = 0.0 if previous is None else max(0.0, at - previous.at)
        totals = []
        for index, uuid in enumerate(present):
            seen = earlier.pop(uuid, None)
            if seen is None:
                total = self.gpus.get((node, uuid))
                if total is None:
                    total = self.gpus[(node, uuid)] = _Total()
                total.first_at = at
                total.last_seen = now
            else:
                total = seen[1]
                total.last_seen = now
                self._count(total, seconds, seen[0], energies[index], utilizations[index], samples, index)
            totals.append(total)
        for uuid in earlier:
            self.gpus.pop((node, uuid), None)  # the GPU left its node: its series ends with it
        return totals

    def _count(
        self,
        total: _Total,
        seconds: float,
        start: float | None,
        end: float | None,
        utilization: float | None,
        samples: Sequence[GpuSample],
        index: int,
    ) -> None:
        """One GPU's interval: idle, busy or unknown; idle joules count for its owners too."""
        part = interval_between(seconds, start, end, utilization)
        if part.joules is None or part.idle is None:
            total.unknown_seconds += part.seconds
            return
        if not part.idle:
            total.busy_joules += part.joules
            return
        total.idle_joules += part.joules
        for owner in set(self.owners(samples[index])):
            owned = self.by_owner.get(owner)
            if owned is None:
                owned = self.by_owner[owner] = _Total()
            owned.idle_joules += part.joules
            owned.last_seen = total.last_seen

    def gpu_totals(self) -> list[tuple[GpuSample, float]]:
        """Each GPU still present, by its newest sample, with its energy while idle so far."""
        found = []
        for (node, uuid), total in sorted(self.gpus.items()):
            seen = self._last.get(node)
            if seen is not None and uuid in seen.uuids:
                found.append((seen.samples[seen.uuids.index(uuid)], total.idle_joules))
        return found

    def summary(self, keys: Iterable[GpuKey]) -> IdleEnergy:
        """Energy while idle of the GPUs ``keys`` name (each once), over all this counter has seen of them.

        A GPU has an entry in ``gpus`` while it is on its node (its entry goes when it leaves), and the sums are
        exact in any order (``math.fsum``): a gateway's all-GPU Explain sums 16,000 GPUs.
        """
        counted: list[_Total] = []
        covered = 0.0
        for key in set(keys):
            total = self.gpus.get(key)
            seen = self._last.get(key[0])
            if total is None or seen is None or total.first_at is None:
                continue
            counted.append(total)
            covered = max(covered, seen.at - total.first_at)
        return IdleEnergy(
            math.fsum(t.idle_joules for t in counted),
            math.fsum(t.busy_joules for t in counted),
            covered,
            math.fsum(t.unknown_seconds for t in counted),
            len(counted),
        )

    def forget_node(self, node: str) -> None:
        """A node that left (its agent left discovery) takes its GPUs' counters with it."""
        seen = self._last.pop(node, None)
        for uuid in seen.uuids if seen is not None else ():
            self.gpus.pop((node, uuid), None)


def pods_of(sample: GpuSample) -> set[tuple[str, str]]:
    """The (namespace, pod) pairs that hold ``sample``'s GPU."""
    return {(ref.namespace, ref.pod) for ref in sample.pods}
