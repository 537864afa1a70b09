"""KEDA's ScaledObjects from the Kubernetes API (keda.sh/v1alpha1): a list, then a watch, kept as scale targets.

KEDA sends every call the ScaledObject's name and namespace; with ``scaleTargetPods`` a trigger asks for the
pods of that ScaledObject's ``spec.scaleTargetRef``. RBAC: get/list/watch on ``scaledobjects.keda.sh``. The
list and watch are ``kube_watch.ListWatch``'s, as the pod watch's are. Until the first list,
while KEDA's CRD is missing (404) or the API has not answered for ``stale_after_seconds``, the directory reports
a problem, so ``scaleTargetPods`` queries fail (UNAVAILABLE) instead of reading as empty.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.gateway.directory.kube_watch import DEFAULT_STALE_AFTER_SECONDS, Collection, ListWatch
from gpuscaler.gateway.directory.names import SeenNames
from gpuscaler.model.pods import ScaleTarget

GROUP, VERSION, PLURAL = "keda.sh", "v1alpha1", "scaledobjects"


def scale_target(scaled_object: Mapping[str, Any]) -> ScaleTarget | None:
    """A ScaledObject (as the API sends it, a dict) to its scale target; None without a name or a target name.

    KEDA's defaults apply: ``kind`` Deployment and ``apiVersion`` apps/v1 when the ref leaves them out.
    """
    metadata = scaled_object.get("metadata") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    ref = (scaled_object.get("spec") or {}).get("scaleTargetRef") or {}
    target = ref.get("name") if isinstance(ref, Mapping) else None
    if not (isinstance(namespace, str) and isinstance(name, str) and isinstance(target, str)):
        return None
    if not (namespace and name and target):
        return None
    kind = ref.get("kind") or "Deployment"
    api_version = ref.get("apiVersion") or "apps/v1"
    return ScaleTarget(namespace, name, str(kind), target, str(api_version))


def _describe(error: ApiException) -> str:
    if error.status == 404:
        return "HTTP 404: KEDA's ScaledObject CRD (scaledobjects.keda.sh/v1alpha1) is not installed"
    if error.status == 403:
        return "HTTP 403: the gateway may not list scaledobjects.keda.sh (the chart's gateway ClusterRole grants it)"
    return f"HTTP {error.status} {error.reason}"


SCALED_OBJECTS: Collection[ScaleTarget] = Collection(
    name="ScaledObject watch",
    items="ScaledObjects",
    event_prefix="scaledobject_watch",
    lister=lambda api: (client.CustomObjectsApi(api).list_cluster_custom_object, (GROUP, VERSION, PLURAL)),
    parse=scale_target,
    key=lambda target: (target.namespace, target.scaled_object),
    namespace=lambda target: target.namespace,
    describe=_describe,
)


class KubernetesScaledObjects(ListWatch[ScaleTarget]):
    """Every ScaledObject's scale target in the cluster, by (namespace, name), from a list and a watch."""

    def __init__(
        self,
        api_client_factory: Callable[[], client.ApiClient],
        *,
        stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
        seen: SeenNames | None = None,
    ) -> None:
        """``seen`` remembers every ScaledObject's namespace and the name its scaleTargetRef gives."""
        super().__init__(
            SCALED_OBJECTS,
            api_client_factory,
            stale_after_seconds=stale_after_seconds,
            on_item=seen.saw_scale_target if seen is not None else None,
        )

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        """The ScaledObject's scale target, if the cluster has it."""
        return self.items.get((namespace, scaled_object))

    def scale_targets_problem(self) -> str | None:
        """Why the ScaledObjects cannot be trusted now (not listed yet, CRD missing, the API silent), or None."""
        return self.problem()

    def __len__(self) -> int:
        return len(self.items)
