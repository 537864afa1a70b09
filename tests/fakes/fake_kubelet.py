"""A fake kubelet: a real gRPC server for the PodResources API on a unix socket, with assignments set live.

Both the in-process tests and the e2e tests (whose agents are other processes) use it: it serves on
the test's event loop, and an agent reads it over the socket exactly as it reads the kubelet.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from gpuscaler.generated import v1 as kubelet

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class Assignment:
    """One container holding devices of one resource (``nvidia.com/gpu`` unless said otherwise)."""

    namespace: str
    pod: str
    device_ids: tuple[str, ...]
    container: str = "main"
    resource_name: str = GPU_RESOURCE


@dataclass(frozen=True, slots=True)
class DraAssignment:
    """One container holding a DRA claim's devices, as (driver, device name) pairs; ``share_id`` is the claim's
    share of a device with consumable capacity (``ClaimResource.share_id``), None when the claim holds it all."""

    namespace: str
    pod: str
    devices: tuple[tuple[str, str], ...]
    container: str = "main"
    claim: str = "gpu-claim"
    share_id: str | None = None


def short_socket_path(name: str = "kubelet.sock") -> Path:
    """A unix socket path well under the 107-byte limit (pytest's tmp_path can be longer)."""
    return Path(tempfile.mkdtemp(prefix="gs-kl-")) / name


@dataclass(eq=False)
class FakeKubelet(kubelet.PodResourcesListerBase):
    """``List`` answers from ``assignments``; ``failure`` makes it answer with that status instead."""

    socket_path: Path
    assignments: list[Assignment | DraAssignment] = field(default_factory=list)
    failure: Status | None = None
    calls: int = 0
    _server: Server | None = None

    async def start(self) -> FakeKubelet:
        self._server = Server([self])
        await self._server.start(path=str(self.socket_path))
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def assign(self, assignments: Sequence[Assignment | DraAssignment]) -> None:
        self.assignments = list(assignments)

    async def list(self, message: kubelet.ListPodResourcesRequest) -> kubelet.ListPodResourcesResponse:
        self.calls += 1
        if self.failure is not None:
            raise GRPCError(self.failure, "fake kubelet failure")
        pods: dict[tuple[str, str], kubelet.PodResources] = {}
        for item in self.assignments:
            pod = pods.setdefault(
                (item.namespace, item.pod), kubelet.PodResources(name=item.pod, namespace=item.namespace)
            )
            container = next((c for c in pod.containers if c.name == item.container), None)
            if container is None:
                container = kubelet.ContainerResources(name=item.container)
                pod.containers.append(container)
            if isinstance(item, Assignment):
                container.devices.append(
                    kubelet.ContainerDevices(resource_name=item.resource_name, device_ids=list(item.device_ids))
                )
            else:
                container.dynamic_resources.append(
                    kubelet.DynamicResource(
                        claim_name=item.claim,
                        claim_namespace=item.namespace,
                        claim_resources=[
                            kubelet.ClaimResource(
                                driver_name=driver, pool_name="node", device_name=device, share_id=item.share_id
                            )
                            for driver, device in item.devices
                        ],
                    )
                )
        return kubelet.ListPodResourcesResponse(pod_resources=list(pods.values()))

    async def get_allocatable_resources(
        self, message: kubelet.AllocatableResourcesRequest
    ) -> kubelet.AllocatableResourcesResponse:
        return kubelet.AllocatableResourcesResponse()

    async def get(self, message: kubelet.GetPodResourcesRequest) -> kubelet.GetPodResourcesResponse:
        raise GRPCError(Status.UNIMPLEMENTED, "the fake kubelet answers List only")
