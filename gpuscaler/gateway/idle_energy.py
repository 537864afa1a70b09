"""Energy while idle per workload at the gateway: each node's new snapshots counted once, GPUs by their pods' owners.

The view announces composed cluster snapshots, each with every node's newest snapshot; the counter takes
those it has not counted yet (by the agent's tick time, which only grows, across agent restarts too). Where
two of a node's snapshots arrived between compositions, the interval between the counted ones is one longer
interval: its joules are still exact (a counter's increase), and its closing sample says whether it was idle.
A GPU counts for the workload of every pod the kubelet assigned it to, once per workload; a pod without an
owner is its own workload. Without a pod directory there are no workloads to
name, and no series.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import compress
from operator import is_not

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuscaler.gateway.view import ClusterView
from gpuscaler.model.pods import PodDirectory
from gpuscaler.model.samples import GpuSample, Snapshot
from gpuscaler.signals.energy import IdleEnergyCounter


class WorkloadIdleEnergy(Collector):
    """``gpuscaler_workload_idle_energy_joules_total`` by namespace and workload; a listener of the view."""

    def __init__(self, view: ClusterView, directory: PodDirectory | None) -> None:
        self._view = view
        self._directory = directory
        self.counter = IdleEnergyCounter(self._workloads)
        self._counted: dict[str, float] = {}  # node -> taken_at of the newest snapshot counted
        self._parts: Sequence[Snapshot] = ()  # the last composition's

    def _workloads(self, sample: GpuSample) -> set[tuple[str, str]]:
        if self._directory is None or self._directory.problem() is not None:
            return set()
        found = set()
        for ref in sample.pods:
            info = self._directory.lookup(ref.namespace, ref.pod)
            found.add((ref.namespace, info.workload if info is not None and info.workload else ref.pod))
        return found

    def on_snapshot(self, cluster: Snapshot) -> None:
        """Count each node snapshot newer than the one counted last."""
        parts, previous = cluster.parts, self._parts
        # Only the nodes that sent since the last composition can be new; found in C, by identity.
        changed = compress(parts, map(is_not, parts, previous)) if len(parts) == len(previous) else parts
        self._parts = parts
        for part in changed:
            if part.taken_at > self._counted.get(part.node, -math.inf):
                self.counter.observe(part)
                self._counted[part.node] = part.taken_at
        for node in self._counted.keys() - self._view.node_names:  # in C: thousands of nodes, 20 times a second
            del self._counted[node]
            self.counter.forget_node(node)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gpuscaler_workload_idle_energy_joules",
            "Energy the workload's GPUs used in poll intervals that closed with gpu_utilization 0 (each GPU once per "
            "workload), counted since this gateway started.",
            labels=["namespace", "workload"],
        )
        for (namespace, workload), total in sorted(self.counter.by_owner.items()):
            family.add_metric([namespace, workload], total.idle_joules)
        yield family
