"""The gateway's pod directory from the Kubernetes API: a list, then a watch, kept in memory (kubernetes-asyncio).

RBAC: get/list/watch on pods, cluster-wide; nothing else (owners come from the pod's own
``ownerReferences`` and ``pod-template-hash`` label, see ``owner_workload``). The list, the watch and
their failures are ``kube_watch.ListWatch``'s: until the first list, and while the API is silent, the
directory reports a problem, so workload queries fail (UNAVAILABLE) instead of reading as empty.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio import client, config

from gpuscaler.gateway.directory.kube_watch import DEFAULT_STALE_AFTER_SECONDS, Collection, ListWatch
from gpuscaler.gateway.directory.names import SeenNames
from gpuscaler.model.errors import ConfigError
from gpuscaler.model.pods import METRICS_PATH_ANNOTATION, METRICS_PORT_ANNOTATION, NVIDIA_RESOURCE_PREFIX, PodInfo

POD_TEMPLATE_HASH = "pod-template-hash"


def owner_workload(
    owner_kind: str | None, owner_name: str | None, labels: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """The (kind, name) of the workload that owns a pod, from its controller reference and labels.

    A Deployment owns its pods through a ReplicaSet named ``<deployment>-<pod-template-hash>``, and the
    pod carries that hash as a label: stripping it gives the Deployment's name without reading the
    ReplicaSet (so the gateway needs no RBAC beyond pods). A ReplicaSet without that label is its own
    workload. StatefulSets, DaemonSets and Jobs own their pods directly.
    """
    if owner_kind is None or owner_name is None:
        return None, None
    if owner_kind == "ReplicaSet":
        template_hash = labels.get(POD_TEMPLATE_HASH)
        if template_hash and owner_name.endswith("-" + template_hash):
            return "Deployment", owner_name[: -len(template_hash) - 1]
    return owner_kind, owner_name


def pod_info(pod: Mapping[str, Any]) -> PodInfo | None:
    """A pod object (as the API sends it, a dict) to what workload queries need; None without a name."""
    metadata = pod.get("metadata") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        return None
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    controller = next(
        (ref for ref in metadata.get("ownerReferences") or [] if isinstance(ref, dict) and ref.get("controller")),
        None,
    )
    kind, workload = owner_workload(
        controller.get("kind") if controller else None, controller.get("name") if controller else None, labels
    )
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    node = spec.get("nodeName")
    annotations = metadata.get("annotations") or {}
    return PodInfo(
        namespace=namespace,
        pod=name,
        labels=labels,
        workload=workload,
        workload_kind=kind,
        node=node if isinstance(node, str) and node else None,
        holds_gpus=_asks_for_gpus(spec),
        uid=uid if isinstance(uid := metadata.get("uid"), str) and uid else None,
        ip=_text(status.get("podIP")),
        phase=_text(status.get("phase")),
        ready=_ready(status),
        deleting=metadata.get("deletionTimestamp") is not None,
        host_network=spec.get("hostNetwork") is True,
        ports=_ports(spec),
        metrics_port=_text(annotations.get(METRICS_PORT_ANNOTATION)),
        metrics_path=_text(annotations.get(METRICS_PATH_ANNOTATION)),
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _ready(status: Mapping[str, Any]) -> bool | None:
    """The pod's Ready condition; None when the status has none yet (a pod not scheduled)."""
    for condition in status.get("conditions") or []:
        if isinstance(condition, dict) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return None


def _ports(spec: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """Every TCP port the pod's containers declare, as (name, number)."""
    ports: list[tuple[str, int]] = []
    for container in spec.get("containers") or []:
        for port in (container.get("ports") or []) if isinstance(container, dict) else []:
            if not isinstance(port, dict) or port.get("protocol", "TCP") != "TCP":
                continue
            number = port.get("containerPort")
            if isinstance(number, int) and not isinstance(number, bool):
                name = port.get("name")
                ports.append((name if isinstance(name, str) else "", number))
    return tuple(ports)


def _asks_for_gpus(spec: Mapping[str, Any]) -> bool:
    """Whether a container requests an ``nvidia.com/...`` resource, or the pod claims DRA devices."""
    if spec.get("resourceClaims"):
        return True
    for group in ("initContainers", "containers"):
        for container in spec.get(group) or []:
            resources = (container.get("resources") or {}) if isinstance(container, dict) else {}
            for kind in ("limits", "requests"):
                if any(str(name).startswith(NVIDIA_RESOURCE_PREFIX) for name in resources.get(kind) or {}):
                    return True
    return False


PODS: Collection[PodInfo] = Collection(
    name="pod watch",
    items="pods",
    event_prefix="pod_watch",
    lister=lambda api: (client.CoreV1Api(api).list_pod_for_all_namespaces, ()),
    parse=pod_info,
    key=lambda info: (info.namespace, info.pod),
    namespace=lambda info: info.namespace,
)


class KubernetesPodDirectory(ListWatch[PodInfo]):
    """Every pod in the cluster, by (namespace, name), from a list and a watch."""

    def __init__(
        self,
        api_client_factory: Callable[[], client.ApiClient],
        *,
        stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
        seen: SeenNames | None = None,
    ) -> None:
        """``seen`` remembers every pod's namespace and owner's name (a pod watch on its own needs none)."""
        self.seen_names = seen
        super().__init__(
            PODS,
            api_client_factory,
            stale_after_seconds=stale_after_seconds,
            on_item=seen.saw_pod if seen is not None else None,
        )

    @classmethod
    async def connect(cls, seen: SeenNames | None = None) -> KubernetesPodDirectory:
        """In a cluster, the pod's service account; outside one, the file ``KUBECONFIG`` names, as kubectl and
        controller-runtime read it (a gateway run by hand, or a test against a real API server); else ConfigError."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException as in_cluster:
            kubeconfig = os.environ.get("KUBECONFIG", "")
            if not kubeconfig:
                raise ConfigError(
                    f"--pod-directory kubernetes: no in-cluster Kubernetes API ({in_cluster}) and no KUBECONFIG; "
                    "outside a cluster, set KUBECONFIG or give a static pod directory file"
                ) from None
            try:
                await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            except (config.ConfigException, OSError, ValueError) as error:
                raise ConfigError(f"--pod-directory kubernetes: KUBECONFIG {kubeconfig!r}: {error}") from None
        return cls(lambda: client.ApiClient(configuration), seen=seen)

    @property
    def api_client_factory(self) -> Callable[[], client.ApiClient]:
        """How this directory reaches the API, for another watch on the same service account."""
        return self.factory

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        """The pod, if the cluster has it."""
        return self.items.get((namespace, pod))

    def pods(self, namespace: str) -> list[PodInfo]:
        """Every pod of ``namespace``."""
        return self.items.in_namespace(namespace)

    def version(self, namespace: str) -> tuple[int, int]:
        """Moves when a pod of ``namespace`` changes, or the names remembered there do."""
        return self.items.version(namespace), self.seen_names.version(namespace) if self.seen_names is not None else 0

    def __len__(self) -> int:
        return len(self.items)
