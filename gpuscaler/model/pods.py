"""Who a pod is, as workload queries need it: its labels, its owner, where it runs, whether it asks for a GPU,
and where its engine's metrics can be read.

The pod directory is the interface; the gateway has two (``gateway/directory/kubernetes.py``, the Kubernetes API,
and ``gateway/directory/pod_file.py``, a static file). A directory is the authority on which pods exist.
A directory that also knows KEDA's ScaledObjects (``ScaleTargets``) lets a trigger with ``scaleTargetPods``
select the pods of its own scale target.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Extended resources of the NVIDIA device plugin: nvidia.com/gpu, nvidia.com/gpu.shared, nvidia.com/mig-1g.5gb, ...
NVIDIA_RESOURCE_PREFIX = "nvidia.com/"
# Where a pod says its metrics are: the annotations Prometheus' kubernetes_sd examples and most charts use.
METRICS_PORT_ANNOTATION = "prometheus.io/port"
METRICS_PATH_ANNOTATION = "prometheus.io/path"


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A pod as workload queries see it. ``node`` and ``holds_gpus`` are None where the source does not say.

    Where a pod runs and whether it asks for a GPU tell a gateway whether a node it cannot hear from may
    hold the pod's GPUs: a share is left out only when it is known to be gone.
    """

    namespace: str
    pod: str
    labels: Mapping[str, str] = field(default_factory=dict)
    workload: str | None = None
    workload_kind: str | None = None
    node: str | None = None
    holds_gpus: bool | None = None
    # The pod's UID: what its processes' cgroups name, so per-process figures can be tied to it (shares.py).
    uid: str | None = None
    # What reading its engine's /metrics needs (engine signals, ``signals/engines/pods.py``); None where unknown.
    ip: str | None = None  # status.podIP
    phase: str | None = None  # status.phase: Pending, Running, Succeeded, Failed
    ready: bool | None = None  # its Ready condition
    deleting: bool = False  # metadata.deletionTimestamp is set: it is terminating
    host_network: bool = False  # its IP is its node's: never read
    ports: tuple[tuple[str, int], ...] = ()  # its containers' declared ports, (name, number); name "" if unnamed
    metrics_port: str | None = None  # its prometheus.io/port annotation, as written
    metrics_path: str | None = None  # its prometheus.io/path annotation, as written


class PodDirectory(Protocol):
    """Pods by (namespace, name), and the names they and KEDA's ScaledObjects carried."""

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        """The pod, or None when the directory does not know it (yet)."""

    def pods(self, namespace: str) -> Iterable[PodInfo]:
        """Every pod it knows in ``namespace``: a look-up, not a pass over the cluster's pods."""

    def problem(self) -> str | None:
        """Why the directory cannot answer now (not synced, API unreachable), or None when it can."""

    def version(self, namespace: str) -> Hashable:
        """Equal before and after means that nothing the directory says of ``namespace`` changed in between: its pods,
        and the names ``seen_names`` remembers (compared for equality only)."""

    @property
    def seen_names(self) -> NameHistory | None:
        """The names it has seen since it started (the gateway's directories remember them), or None."""


# The workload kinds whose pods a directory can name (a pod's owner, with Deployments through their
# ReplicaSets); a scale target of another kind (an Argo Rollout, a custom resource) cannot be resolved to pods.
SCALE_TARGET_KINDS = frozenset({"Deployment", "StatefulSet"})


@dataclass(frozen=True, slots=True)
class ScaleTarget:
    """A ScaledObject's ``spec.scaleTargetRef``: what KEDA scales, in the ScaledObject's namespace."""

    namespace: str
    scaled_object: str
    kind: str
    name: str
    api_version: str = "apps/v1"


@runtime_checkable
class ScaleTargets(Protocol):
    """KEDA's ScaledObjects by (namespace, name)."""

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        """The ScaledObject's scale target, or None when the directory does not know the ScaledObject."""

    def scale_targets_problem(self) -> str | None:
        """Why the ScaledObjects cannot be read now (not listed yet, API unreachable, no KEDA CRD), or None."""


# What carried a workload name a directory remembers (``NameHistory``): a pod's owner, a ScaledObject's target.
POD_OWNER = "pod"
SCALE_TARGET_REF = "scaleTargetRef"


class NameHistory(Protocol):
    """The names a directory has seen since it started, within a cap: what tells a selection that matches no pod
    because its workload is at zero from one that names nothing there is (``signals/empty_selection.py``)."""

    def carriers(self, namespace: str, name: str) -> frozenset[str]:
        """What carried the workload name in ``namespace``: ``POD_OWNER`` and/or ``SCALE_TARGET_REF``; empty if none."""

    def workload_names(self, namespace: str) -> Collection[str]:
        """The workload names carried in ``namespace``."""

    def namespaces_with(self, name: str) -> Collection[str]:
        """The namespaces where the workload name was carried."""

    def workload_names_anywhere(self) -> Collection[str]:
        """Every workload name carried in any namespace, each once."""

    def namespaces(self) -> Collection[str]:
        """The namespaces that held a pod or a ScaledObject."""


def uid_key(uid: str) -> str:
    """A pod UID as both the cgroup and the API spell it: lowercase, without dashes or underscores."""
    return uid.replace("-", "").replace("_", "").lower()
