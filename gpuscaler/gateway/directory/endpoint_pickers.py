"""Which pods are an InferencePool's endpoint picker (EPP): InferencePools and the Services they name, watched.

An InferencePool (inference.networking.k8s.io/v1) names its EPP by ``spec.endpointPickerRef`` {group, kind, name,
port}: a Service of the pool's own namespace (kind defaults to Service, group to ""; GIE v1.5.0
``api/v1/inferencepool_types.go``). A pod is that EPP's when it is in that namespace and carries every label of
the Service's selector, as the Service's own EndpointSlices would list it; the selector is read rather than the
EndpointSlices because the pod watch already holds every pod's labels, and EndpointSlices drop a pod that is not
Ready, while a pod is judged here whatever its state (a pod not Ready is not read for signals, and one not Running
or being deleted gets no token: ``engines.epp_token.EppCredentials``). A Service without a
selector, or an ``endpointPickerRef`` of another kind (ExternalName is refused by GIE itself), names no pod.

Only the ``--epp-namespaces`` are watched, each on its own (a namespaced list and watch of each kind): a pod
elsewhere gets no token whatever its pools say, so the gateway neither holds nor may read other namespaces' pools
and Services. RBAC: list/watch on ``inferencepools.inference.networking.k8s.io`` and on services, in those
namespaces alone (a Role in each). Memory: per pool of those namespaces its namespace, name and the Service's
name; per Service its selector alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.gateway.directory.kube_watch import DEFAULT_STALE_AFTER_SECONDS, Collection, ListWatch
from gpuscaler.model.pods import PodInfo

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


@dataclass(frozen=True, slots=True)
class PickerRef:
    """An InferencePool and the Service its endpointPickerRef names (in the pool's namespace)."""

    namespace: str
    pool: str
    service: str | None  # None: a ref that names no Service (another kind or group)


@dataclass(frozen=True, slots=True)
class ServiceSelector:
    """A Service's pod selector; empty when it has none (its endpoints are managed by hand)."""

    namespace: str
    name: str
    selector: tuple[tuple[str, str], ...]


def picker_ref(pool: Mapping[str, Any]) -> PickerRef | None:
    """An InferencePool (as the API sends it) to the Service it names; None without a namespace and name."""
    metadata = pool.get("metadata") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not (isinstance(namespace, str) and namespace and isinstance(name, str) and name):
        return None
    ref = (pool.get("spec") or {}).get("endpointPickerRef") or {}
    if not isinstance(ref, Mapping):
        return PickerRef(namespace, name, None)
    kind, group, service = ref.get("kind") or "Service", ref.get("group") or "", ref.get("name")
    if kind != "Service" or group != "" or not isinstance(service, str) or not service:
        return PickerRef(namespace, name, None)
    return PickerRef(namespace, name, service)


def service_selector(service: Mapping[str, Any]) -> ServiceSelector | None:
    """A Service (as the API sends it) to its selector; None without a namespace and name."""
    metadata = service.get("metadata") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not (isinstance(namespace, str) and namespace and isinstance(name, str) and name):
        return None
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    if spec.get("type") == "ExternalName" or not isinstance(selector, Mapping):
        selector = {}
    return ServiceSelector(namespace, name, tuple(sorted((str(k), str(v)) for k, v in selector.items())))


def _describe(what: str) -> Callable[[ApiException], str]:
    def describe(error: ApiException) -> str:
        if error.status == 404 and what == "inferencepools":
            return "HTTP 404: the InferencePool CRD (inferencepools.inference.networking.k8s.io/v1) is not installed"
        if error.status == 403:
            return f"HTTP 403: the gateway may not list {what} (the chart grants it with gateway.epp.metricsToken)"
        return f"HTTP {error.status} {error.reason}"

    return describe


def pools_in(namespace: str) -> Collection[PickerRef]:
    """The InferencePools of ``namespace``, listed and watched there alone."""
    return Collection(
        name=f"InferencePool watch of namespace {namespace}",
        items="InferencePools",
        event_prefix="inferencepool_watch",
        lister=lambda api: (
            client.CustomObjectsApi(api).list_namespaced_custom_object,
            (GROUP, VERSION, namespace, PLURAL),
        ),
        parse=picker_ref,
        key=lambda ref: (ref.namespace, ref.pool),
        namespace=lambda ref: ref.namespace,
        describe=_describe("inferencepools"),
    )


def services_in(namespace: str) -> Collection[ServiceSelector]:
    """The Services of ``namespace``, listed and watched there alone."""
    return Collection(
        name=f"Service watch of namespace {namespace}",
        items="Services",
        event_prefix="service_watch",
        lister=lambda api: (client.CoreV1Api(api).list_namespaced_service, (namespace,)),
        parse=service_selector,
        key=lambda service: (service.namespace, service.name),
        namespace=lambda service: service.namespace,
        describe=_describe("services"),
    )


class EndpointPickers:
    """Whether a pod is the EPP an InferencePool's endpointPickerRef names, from two watches in each of
    ``namespaces`` (the trusted ones, ``--epp-namespaces``)."""

    def __init__(
        self,
        api_client_factory: Callable[[], client.ApiClient],
        namespaces: Iterable[str],
        *,
        stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
    ) -> None:
        self.watches = {
            namespace: (
                ListWatch(pools_in(namespace), api_client_factory, stale_after_seconds=stale_after_seconds),
                ListWatch(services_in(namespace), api_client_factory, stale_after_seconds=stale_after_seconds),
            )
            for namespace in namespaces
        }

    async def start(self) -> None:
        for pools, services in self.watches.values():
            await pools.start()
            await services.start()

    async def stop(self) -> None:
        for pools, services in self.watches.values():
            await services.stop()
            await pools.stop()

    def problem(self) -> str | None:
        """Why no pod can be judged now (a watch not listed yet, or the API silent), or None."""
        for pools, services in self.watches.values():
            problem = pools.problem() or services.problem()
            if problem is not None:
                return problem
        return None

    def pool_of(self, info: PodInfo) -> str | None:
        """The InferencePool whose endpointPickerRef's Service selects ``info``, or None: no pool names it (a pod
        outside the watched namespaces is named by none)."""
        watched = self.watches.get(info.namespace)
        if watched is None:
            return None
        pools, services = watched
        for ref in pools.items.in_namespace(info.namespace):
            if ref.service is None:
                continue
            service = services.items.get((info.namespace, ref.service))
            if service is None or not service.selector:
                continue
            if all(info.labels.get(key) == value for key, value in service.selector):
                return ref.pool
        return None
