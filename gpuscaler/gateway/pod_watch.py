"""The gateway's pod directory from the Kubernetes API: a list, then a watch, kept in memory (kubernetes-asyncio).

RBAC: get/list/watch on pods, cluster-wide; nothing else (owners come from the pod's own
``ownerReferences`` and ``pod-template-hash`` label, see ``owner_workload``). The watch
resumes from the last resourceVersion; a 410 Gone (history compacted) relists. Until the first list
has arrived, and while the API cannot be reached for longer than ``stale_after_seconds``, the
directory reports a problem, so workload queries fail (UNAVAILABLE) instead of reading as empty.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.errors import ConfigError
from gpuscaler.pods import NVIDIA_RESOURCE_PREFIX, PodInfo

log = structlog.get_logger(__name__)

WATCH_TIMEOUT_SECONDS = 300  # the API server ends each watch after this; we resume from where it was
INITIAL_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
DEFAULT_STALE_AFTER_SECONDS = 60.0
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
    node = spec.get("nodeName")
    return PodInfo(
        namespace=namespace,
        pod=name,
        labels=labels,
        workload=workload,
        workload_kind=kind,
        node=node if isinstance(node, str) and node else None,
        holds_gpus=_asks_for_gpus(spec),
        uid=uid if isinstance(uid := metadata.get("uid"), str) and uid else None,
    )


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


class KubernetesPodDirectory:
    """Every pod in the cluster, by (namespace, name), from a list and a watch."""

    def __init__(
        self,
        api_client_factory: Callable[[], client.ApiClient],
        *,
        stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
    ) -> None:
        self._factory = api_client_factory
        self._pods: dict[tuple[str, str], PodInfo] = {}
        self._synced = False
        self._last_contact: float | None = None
        self._stale_after = stale_after_seconds
        self._error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._api: client.ApiClient | None = None
        self.lists = 0
        self.events = 0

    @classmethod
    def in_cluster(cls) -> KubernetesPodDirectory:
        """The pod's service account and the API server it is given; ConfigError outside a cluster."""
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException as error:
            raise ConfigError(
                f"--pod-directory kubernetes: no in-cluster Kubernetes API ({error}); outside a cluster, "
                "give a static pod directory file"
            ) from None
        return cls(lambda: client.ApiClient(configuration))

    @property
    def api_client_factory(self) -> Callable[[], client.ApiClient]:
        """How this directory reaches the API, for another watch on the same service account."""
        return self._factory

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        return self._pods.get((namespace, pod))

    def pods(self, namespace: str) -> list[PodInfo]:
        return [info for (space, _), info in self._pods.items() if space == namespace]

    def problem(self) -> str | None:
        if not self._synced:
            detail = f": {self._error}" if self._error else ""
            return f"the pod watch has not listed the pods yet{detail}"
        now = asyncio.get_running_loop().time()
        if self._error and self._last_contact is not None and now - self._last_contact > self._stale_after:
            return f"the Kubernetes API has not answered for {now - self._last_contact:.0f}s: {self._error}"
        return None

    def __len__(self) -> int:
        return len(self._pods)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pod-watch")

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
                core = client.CoreV1Api(self._api)
                if resource_version is None:
                    resource_version = await self._list(core)
                resource_version = await self._watch(core, resource_version)
                backoff = INITIAL_BACKOFF_SECONDS
            except ApiException as error:
                if error.status == 410:
                    log.info("pod_watch_expired", detail=str(error.reason))
                    resource_version = None  # the history moved on: list again
                    continue
                self._failed(f"HTTP {error.status} {error.reason}", backoff)
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
            log.warning("pod_watch_failed", error=detail, retry_in=backoff)
        self._error = detail

    async def _list(self, core: client.CoreV1Api) -> str:
        # The raw answer: a cluster's pods as plain dicts, without building a model object per field.
        response: Any = await core.list_pod_for_all_namespaces(_preload_content=False)
        try:
            # A raw answer is not checked for us: a 403 (RBAC) or 500 would otherwise read as "no pods", and every
            # workload as scaled to zero.
            if response.status >= 300:
                raise ApiException(status=response.status, reason=response.reason)
            document = await response.json()
        finally:
            response.release()
        pods: dict[tuple[str, str], PodInfo] = {}
        for item in document.get("items") or []:
            info = pod_info(item)
            if info is not None:
                pods[(info.namespace, info.pod)] = info
        self._pods = pods
        self._contact()
        self.lists += 1
        if not self._synced:
            log.info("pod_watch_synced", pods=len(pods))
        self._synced = True
        return str((document.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, core: client.CoreV1Api, resource_version: str) -> str:
        """Apply events until the server ends the watch; the resourceVersion to resume from."""
        stream = watch.Watch(return_type="object")
        async with stream:
            async for event in stream.stream(
                core.list_pod_for_all_namespaces,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
            ):
                self._contact()
                kind = event.get("type")
                info = pod_info(event.get("raw_object") or {})
                if info is None:
                    continue
                self.events += 1
                if kind == "DELETED":
                    self._pods.pop((info.namespace, info.pod), None)
                elif kind in ("ADDED", "MODIFIED"):
                    self._pods[(info.namespace, info.pod)] = info
        return str(stream.resource_version or resource_version)

    def _contact(self) -> None:
        self._last_contact = asyncio.get_running_loop().time()
        self._error = None
