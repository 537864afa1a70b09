"""KEDA's ScaledObjects from the Kubernetes API (keda.sh/v1alpha1): a list, then a watch, kept as scale targets.

KEDA sends every call the ScaledObject's name and namespace; with ``scaleTargetPods`` a trigger asks for the
pods of that ScaledObject's ``spec.scaleTargetRef``. RBAC: get/list/watch on ``scaledobjects.keda.sh``. The
watch resumes from the last resourceVersion and relists on 410 Gone, as the pod watch does. Until the first list,
while KEDA's CRD is missing (404) or the API has not answered for ``stale_after_seconds``, the directory reports
a problem, so ``scaleTargetPods`` queries fail (UNAVAILABLE) instead of reading as empty.

``KubernetesDirectory`` is the gateway's ``--pod-directory kubernetes``: the pod watch and this one together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.gateway.pod_watch import KubernetesPodDirectory
from gpuscaler.pods import PodInfo, ScaleTarget

log = structlog.get_logger(__name__)

GROUP, VERSION, PLURAL = "keda.sh", "v1alpha1", "scaledobjects"
WATCH_TIMEOUT_SECONDS = 300
INITIAL_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
DEFAULT_STALE_AFTER_SECONDS = 60.0


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


class KubernetesScaledObjects:
    """Every ScaledObject's scale target in the cluster, by (namespace, name), from a list and a watch."""

    def __init__(
        self,
        api_client_factory: Callable[[], client.ApiClient],
        *,
        stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
    ) -> None:
        self._factory = api_client_factory
        self._targets: dict[tuple[str, str], ScaleTarget] = {}
        self._synced = False
        self._last_contact: float | None = None
        self._stale_after = stale_after_seconds
        self._error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._api: client.ApiClient | None = None
        self.lists = 0
        self.events = 0

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        return self._targets.get((namespace, scaled_object))

    def scale_targets_problem(self) -> str | None:
        if not self._synced:
            detail = f": {self._error}" if self._error else ""
            return f"the ScaledObject watch has not listed the ScaledObjects yet{detail}"
        now = asyncio.get_running_loop().time()
        if self._error and self._last_contact is not None and now - self._last_contact > self._stale_after:
            silent = now - self._last_contact
            return f"the Kubernetes API has not answered the ScaledObject watch for {silent:.0f}s: {self._error}"
        return None

    def __len__(self) -> int:
        return len(self._targets)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scaledobject-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF_SECONDS
        resource_version: str | None = None
        while True:
            try:
                if self._api is None:
                    self._api = self._factory()
                custom = client.CustomObjectsApi(self._api)
                if resource_version is None:
                    resource_version = await self._list(custom)
                resource_version = await self._watch(custom, resource_version)
                backoff = INITIAL_BACKOFF_SECONDS
            except ApiException as error:
                if error.status == 410:
                    log.info("scaledobject_watch_expired", detail=str(error.reason))
                    resource_version = None
                    continue
                self._failed(_describe(error), backoff)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
                self._failed(repr(error), backoff)
            except Exception as error:  # noqa: BLE001 - a malformed answer must not end the watch for good
                self._failed(f"unexpected answer: {error!r}", backoff)
            else:
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _failed(self, detail: str, backoff: float) -> None:
        if self._error != detail:
            log.warning("scaledobject_watch_failed", error=detail, retry_in=backoff)
        self._error = detail

    async def _list(self, custom: client.CustomObjectsApi) -> str:
        response: Any = await custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _preload_content=False)
        try:
            if response.status >= 300:  # a raw answer is not checked for us: a 404 would read as no ScaledObjects
                raise ApiException(status=response.status, reason=response.reason)
            document = await response.json()
        finally:
            response.release()
        self._targets = _by_key(scale_target(item) for item in document.get("items") or [])
        self._contact()
        self.lists += 1
        if not self._synced:
            log.info("scaledobject_watch_synced", scaled_objects=len(self._targets))
        self._synced = True
        return str((document.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, custom: client.CustomObjectsApi, resource_version: str) -> str:
        stream = watch.Watch(return_type="object")
        async with stream:
            async for event in stream.stream(
                custom.list_cluster_custom_object,
                GROUP,
                VERSION,
                PLURAL,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
            ):
                self._contact()
                target = scale_target(event.get("raw_object") or {})
                if target is None:
                    continue
                self.events += 1
                key = (target.namespace, target.scaled_object)
                if event.get("type") == "DELETED":
                    self._targets.pop(key, None)
                elif event.get("type") in ("ADDED", "MODIFIED"):
                    self._targets[key] = target
        return str(stream.resource_version or resource_version)

    def _contact(self) -> None:
        self._last_contact = asyncio.get_running_loop().time()
        self._error = None


def _by_key(targets: Iterable[ScaleTarget | None]) -> dict[tuple[str, str], ScaleTarget]:
    return {(t.namespace, t.scaled_object): t for t in targets if t is not None}


def _describe(error: ApiException) -> str:
    if error.status == 404:
        return "HTTP 404: KEDA's ScaledObject CRD (scaledobjects.keda.sh/v1alpha1) is not installed"
    if error.status == 403:
        return "HTTP 403: the gateway may not list scaledobjects.keda.sh (the chart's gateway ClusterRole grants it)"
    return f"HTTP {error.status} {error.reason}"


class KubernetesDirectory:
    """The gateway's ``--pod-directory kubernetes``: pods from the pod watch, scale targets from the ScaledObjects."""

    def __init__(self, pods: KubernetesPodDirectory, scaled_objects: KubernetesScaledObjects) -> None:
        self.pod_watch = pods
        self.scaled_objects = scaled_objects

    @classmethod
    def in_cluster(cls) -> KubernetesDirectory:
        """Both watches on the pod's service account; ConfigError outside a cluster."""
        pods = KubernetesPodDirectory.in_cluster()
        return cls(pods, KubernetesScaledObjects(pods.api_client_factory))

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        return self.pod_watch.lookup(namespace, pod)

    def pods(self, namespace: str) -> list[PodInfo]:
        return self.pod_watch.pods(namespace)

    def problem(self) -> str | None:
        return self.pod_watch.problem()

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        return self.scaled_objects.scale_target(namespace, scaled_object)

    def scale_targets_problem(self) -> str | None:
        return self.scaled_objects.scale_targets_problem()

    async def start(self) -> None:
        await self.pod_watch.start()
        await self.scaled_objects.start()

    async def stop(self) -> None:
        await self.scaled_objects.stop()
        await self.pod_watch.stop()
