"""A pod's own share of a GPU it shares with other pods (time-slicing, MPS), from the agent's per-process figures.

NVML reports one utilisation per GPU. Where several pods hold one GPU, a pod query would count that whole value
for each of them; with per-process reads on (``--processes``), the agent sends each process's share of SM time,
memory-controller time and memory, with the pod UID its cgroup names. A pod's share is the sum over its own
processes. The pod UID is what joins the two: the gateway's pod directory knows each pod's UID (the pod watch
reads ``metadata.uid``); a node agent has no pod directory, so there a shared GPU keeps counting in full.

A GPU one pod holds alone counts in full for it, as before: it is that pod's whole GPU, and NVML's own
device-wide figure is the better measurement of it. Every contribution says which of the two it used.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.model.pods import PodInfo, uid_key
from gpuscaler.model.samples import PROCESSES_FIELD, GpuSample, ProcessUsage


@dataclass(frozen=True, slots=True)
class Share:
    """How a pod's value on one GPU is taken: its own processes' share (``pod_uid`` set) or the whole GPU's."""

    pod_uid: str | None
    basis: str  # in words, for Explain: what the value is, and why


def holders(sample: GpuSample) -> int:
    """How many pods the kubelet assigned ``sample``'s GPU to."""
    return len({(ref.namespace, ref.pod) for ref in sample.pods})


def share_basis(sample: GpuSample, metric: Metric, info: PodInfo | None) -> Share:
    """Whether a pod (``info``) reads its own share of ``sample``'s GPU for ``metric``, and the words that say so."""
    pods = holders(sample)
    if pods < 2:
        return Share(None, "whole GPU (this pod holds it alone)")
    shared = f"whole GPU, shared by {pods} pods"
    if METRICS[metric].per_process is None:
        return Share(None, f"{shared}: NVML has no per-process {metric.value}")
    if sample.processes is None:
        reason = next((e.detail for e in sample.errors if e.field == PROCESSES_FIELD), None)
        why = f"its processes could not be read ({reason})" if reason else "the agent reads no processes (--processes)"
        return Share(None, f"{shared}: {why}")
    if info is None or not info.uid:
        return Share(
            None,
            f"{shared}: its processes are known by pod UID, and this server does not know the pod's UID (the gateway's "
            "pod directory does)",
        )
    value = pod_share(sample, metric, info.uid)
    if value is None:
        return Share(None, f"{shared}: NVML gave no per-process {metric.value} figures")
    mine = _own(sample, info.uid)
    unknown = sum(1 for process in sample.processes if process.pod_uid is None)
    basis = f"own share: {len(mine)} of its {len(sample.processes)} processes, on a GPU shared by {pods} pods"
    if unknown:
        basis += f" ({unknown} process(es) whose pod could not be read are in no pod's share)"
    return Share(info.uid, basis)


def pod_share(sample: GpuSample, metric: Metric, pod_uid: str) -> float | None:
    """The pod's own share of ``metric`` on ``sample``'s GPU, in the metric's unit; None without the figures."""
    info = METRICS[metric]
    field = info.per_process
    if field is None or sample.processes is None:
        return None
    values = [getattr(process, field) for process in _own(sample, pod_uid)]
    if any(value is None for value in values):
        return None
    total = float(sum(values))
    if info.of is None:
        return total
    whole = getattr(sample, info.of)
    return None if not whole else 100.0 * total / whole


def _own(sample: GpuSample, pod_uid: str) -> list[ProcessUsage]:
    key = uid_key(pod_uid)
    return [p for p in sample.processes or () if p.pod_uid and uid_key(p.pod_uid) == key]
