"""The gateway's ``--pod-directory kubernetes``: the pod watch and the ScaledObject watch, as one directory."""

from __future__ import annotations

from typing import Protocol

from gpuscaler.gateway.directory.names import SeenNames
from gpuscaler.gateway.directory.pod_watch import KubernetesPodDirectory
from gpuscaler.gateway.directory.scaled_objects import KubernetesScaledObjects
from gpuscaler.model.pods import PodInfo, ScaleTarget


class Watched(Protocol):
    """A watch started and stopped with the directory."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class KubernetesDirectory:
    """The gateway's ``--pod-directory kubernetes``: pods from the pod watch, scale targets from the ScaledObjects."""

    def __init__(
        self, pods: KubernetesPodDirectory, scaled_objects: KubernetesScaledObjects, seen: SeenNames | None = None
    ) -> None:
        """``seen``: the names both watches remember (given to them), for selections that match no pod."""
        self.pod_watch = pods
        self.scaled_objects = scaled_objects
        self.seen_names = seen if seen is not None else SeenNames()
        self._also: list[Watched] = []

    def also_watch(self, watched: Watched) -> None:
        """Start and stop ``watched`` with this directory (the InferencePool and Service watches)."""
        self._also.append(watched)

    @classmethod
    async def connect(cls) -> KubernetesDirectory:
        """Both watches on one connection: the pod's service account, or KUBECONFIG outside a cluster."""
        seen = SeenNames()
        pods = await KubernetesPodDirectory.connect(seen)
        return cls(pods, KubernetesScaledObjects(pods.api_client_factory, seen=seen), seen)

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        return self.pod_watch.lookup(namespace, pod)

    def pods(self, namespace: str) -> list[PodInfo]:
        return self.pod_watch.pods(namespace)

    def version(self, namespace: str) -> tuple[int, int]:
        """Moves when a pod of ``namespace`` changes, or the names both watches remember there do."""
        return self.pod_watch.items.version(namespace), self.seen_names.version(namespace)

    def problem(self) -> str | None:
        return self.pod_watch.problem()

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        return self.scaled_objects.scale_target(namespace, scaled_object)

    def scale_targets_problem(self) -> str | None:
        return self.scaled_objects.scale_targets_problem()

    async def start(self) -> None:
        await self.pod_watch.start()
        await self.scaled_objects.start()
        for watched in self._also:
            await watched.start()

    async def stop(self) -> None:
        for watched in self._also:
            await watched.stop()
        await self.scaled_objects.stop()
        await self.pod_watch.stop()
