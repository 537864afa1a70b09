"""The node suite's cluster as the tests use it: the control plane, the node, helm, and waits on what the API says.

Everything here blocks (the API client is synchronous); the async tests call it through ``asyncio.to_thread`` where
a wait must not hold up the event loop. Every wait polls a state with a deadline and fails saying what it last saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from grpclib.client import Channel

from e2e.keda.control_plane import ApiError, ControlPlane, Json, Kube, object_path
from e2e.node.images import BUSYBOX_IMAGE, WORKLOAD_COMMAND
from e2e.node.node import Node
from gpuscaler.generated import v1 as podresources

GPU_RESOURCE = "nvidia.com/gpu"
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
CHART = REPOSITORY_ROOT / "charts" / "gpuscaler"
# The chart's image as its defaults name it (registry "", repository gpuscaler/gpuscaler, tag appVersion): the CRI
# reads a name without a registry as docker.io's, so the image is imported under that name too.
CHART_IMAGE = "docker.io/gpuscaler/gpuscaler"

T = TypeVar("T")


@dataclass
class Deadline:
    """Polls ``probe`` until ``accept`` says yes; fails after ``timeout`` seconds with ``what`` and the last value."""

    what: str
    timeout: float
    interval: float = 0.25

    def until(self, probe: Callable[[], T], accept: Callable[[T], bool], check: Callable[[], None] | None = None) -> T:
        deadline = time.monotonic() + self.timeout
        last: T | str = "(never read)"
        while True:
            try:
                value = probe()
            except (ApiError, OSError) as error:
                last = f"{error!r}"
            else:
                if accept(value):
                    return value
                last = value
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.what}: not within {self.timeout:g}s; last: {last}")
            time.sleep(self.interval)


async def eventually(
    what: str,
    timeout: float,
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    check: Callable[[], None] | None = None,
) -> T:
    """``Deadline.until`` for an async probe, on the event loop."""
    deadline = time.monotonic() + timeout
    last: T | str = "(never read)"
    while True:
        try:
            value = await probe()
        except (ApiError, OSError, AssertionError) as error:
            last = f"{error!r}"
        else:
            if accept(value):
                return value
            last = value
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s; last: {last}")
        await asyncio.sleep(0.25)


def condition(document: Json | None, kind: str) -> str | None:
    """The status of condition ``kind`` ("True", "False"), or None."""
    for found in ((document or {}).get("status") or {}).get("conditions") or []:
        if found.get("type") == kind:
            return str(found.get("status"))
    return None


def gpu_deployment(
    name: str, namespace: str, *, replicas: int, gpus: int = 1, labels: Mapping[str, str] | None = None
) -> Json:
    """A Deployment whose pods request ``gpus`` nvidia.com/gpu each and run busybox (they print the devices they got,
    then sleep until SIGTERM)."""
    command = [*WORKLOAD_COMMAND[:-1], f'echo "gpus=$NVIDIA_VISIBLE_DEVICES"; {WORKLOAD_COMMAND[-1]}']
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, **(labels or {})}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "main",
                            "image": BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": command,
                            "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                        }
                    ],
                },
            },
        },
    }


@dataclass(frozen=True)
class Holding:
    """One container's devices of one resource, as the kubelet's PodResources API reports them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


async def _list(socket: Path) -> podresources.ListPodResourcesResponse:
    """The kubelet's PodResources ``List`` answer, as the agent reads it."""
    channel = Channel(path=str(socket))
    try:
        return await podresources.PodResourcesListerStub(channel).list(
            podresources.ListPodResourcesRequest(), timeout=10
        )
    finally:
        channel.close()


async def pod_resources(socket: Path = POD_RESOURCES_SOCKET) -> list[Holding]:
    """The kubelet's PodResources ``List``: every container's devices (what the agent reads)."""
    answer = await _list(socket)
    return [
        Holding(pod.namespace, pod.name, container.name, devices.resource_name, tuple(devices.device_ids))
        for pod in answer.pod_resources
        for container in pod.containers
        for devices in container.devices
    ]


@dataclass(frozen=True)
class DraHolding:
    """One DRA device a container holds through a claim, as the kubelet's PodResources API reports it."""

    namespace: str
    pod: str
    container: str
    claim: str
    driver: str
    pool: str
    device: str
    share_id: str | None


async def dra_holdings(socket: Path = POD_RESOURCES_SOCKET) -> list[DraHolding]:
    """The kubelet's PodResources ``List``: every container's DRA devices (``dynamic_resources``)."""
    answer = await _list(socket)
    return [
        DraHolding(
            pod.namespace,
            pod.name,
            container.name,
            claim.claim_name,
            resource.driver_name,
            resource.pool_name,
            resource.device_name,
            resource.share_id,
        )
        for pod in answer.pod_resources
        for container in pod.containers
        for claim in container.dynamic_resources
        for resource in claim.claim_resources
    ]


@dataclass
class NodeCluster:
    """The running control plane and node, for the whole session; ``helm`` is the chart tests' helm binary."""

    plane: ControlPlane
    node: Node
    helm_binary: Path
    directory: Path
    releases: list[tuple[str, str]] = field(default_factory=list)

    @property
    def kube(self) -> Kube:
        """The control plane's API client."""
        return self.plane.kube

    def check_alive(self) -> None:
        """Raises if a control-plane or node process died."""
        self.plane.check_alive()

    # --- objects ---------------------------------------------------------------------------------------

    def apply(self, document: Mapping[str, Any]) -> Json:
        """Server-side apply with strict validation."""
        return self.kube.apply(document)

    def delete(self, document: Mapping[str, Any]) -> None:
        self.kube.delete(document)

    def wait_gone(self, document: Mapping[str, Any], timeout: float = 120) -> None:
        """Waits until the object no longer exists (its finalizers done)."""
        Deadline(f"{document['kind']} {document['metadata']['name']} to be gone", timeout).until(
            lambda: self.kube.get(object_path(document)), lambda found: found is None, self.check_alive
        )

    def pods(self, namespace: str, selector: str) -> list[Json]:
        """The pods matching a label selector, oldest first."""
        query = urllib.parse.urlencode({"labelSelector": selector})
        items: list[Json] = self.kube.request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}")["items"]
        return sorted(items, key=lambda pod: (pod["metadata"]["creationTimestamp"], pod["metadata"]["name"]))

    def running_pods(self, namespace: str, selector: str) -> list[Json]:
        """The matching pods that are Running and Ready and not being deleted."""
        return [
            pod
            for pod in self.pods(namespace, selector)
            if not pod["metadata"].get("deletionTimestamp")
            and pod.get("status", {}).get("phase") == "Running"
            and condition(pod, "Ready") == "True"
        ]

    def wait_running(self, namespace: str, selector: str, count: int, timeout: float = 180) -> list[Json]:
        """Waits until exactly ``count`` matching pods exist, all Running and Ready; returns them."""

        def probe() -> tuple[list[Json], list[Json]]:
            return self.pods(namespace, selector), self.running_pods(namespace, selector)

        def accept(found: tuple[list[Json], list[Json]]) -> bool:
            every, ready = found
            return len(every) == count and len(ready) == count

        _, ready = Deadline(f"{count} Ready pods for {selector} in {namespace}", timeout).until(
            probe, accept, self.check_alive
        )
        return ready

    def describe_pods(self, namespace: str, selector: str = "") -> str:
        """Each pod's phase, readiness, container states and log tails, and the namespace's latest events: what a
        failure message needs (the kubelet deletes a pod's logs with the pod)."""
        lines = []
        for pod in self.pods(namespace, selector):
            name, status = pod["metadata"]["name"], pod.get("status", {})
            lines.append(f"pod {name}: {status.get('phase')}, Ready {condition(pod, 'Ready')}")
            for container in status.get("containerStatuses", []):
                last = container.get("lastState", {}).get("terminated")
                lines.append(
                    f"  {container['name']}: ready {container.get('ready')}, restarts {container.get('restartCount')}, "
                    f"state {container.get('state')}" + (f", last terminated {last}" if last else "")
                )
                for previous in ("false", "true"):
                    with contextlib.suppress(ApiError, OSError):
                        tail = self.kube.text(
                            f"/api/v1/namespaces/{namespace}/pods/{name}/log?container={container['name']}"
                            f"&tailLines=15&previous={previous}"
                        )
                        lines += [
                            f"    {'previous' if previous == 'true' else 'log'}: {line}" for line in tail.splitlines()
                        ]
        events = self.kube.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        lines += [f"event {e['involvedObject']['name']}: {e['reason']}: {e.get('message')}" for e in events[-20:]]
        return "\n".join(lines)

    def wait_replacement(self, namespace: str, app: str, deleted: str, timeout: float = 180) -> Json:
        """The one Running pod of Deployment ``app`` (label ``app=<app>``) that replaced the deleted pod ``deleted``."""
        pods = Deadline(f"{app}'s replacement for {deleted}", timeout).until(
            lambda: self.running_pods(namespace, f"app={app}"),
            lambda found: len(found) == 1 and found[0]["metadata"]["name"] != deleted,
            self.check_alive,
        )
        return pods[0]

    def log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A container's log through the API server (which fetches it from the kubelet)."""
        query = f"?container={container}" if container else ""
        return str(self.kube.text(f"/api/v1/namespaces/{namespace}/pods/{pod}/log{query}"))

    # --- helm ------------------------------------------------------------------------------------------

    def helm(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """helm with the cluster's kubeconfig; raises with its output when it fails."""
        assert self.plane.kubeconfig is not None
        result = subprocess.run(
            [str(self.helm_binary), "--kubeconfig", str(self.plane.kubeconfig), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"HOME": str(self.directory / "helm-home"), "PATH": "/usr/bin:/bin"},
        )
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        return result

    def install(
        self, release: str, namespace: str, *, values: Sequence[Path] = (), sets: Mapping[str, str] | None = None
    ) -> None:
        """``helm install`` of the chart from this checkout, with values files and --set pairs."""
        argv = ["install", release, str(CHART), "--namespace", namespace, "--create-namespace"]
        for path in values:
            argv += ["--values", str(path)]
        for key, value in (sets or {}).items():
            argv += ["--set", f"{key}={value}"]
        # Recorded first: a failed install leaves a release behind that only an uninstall removes.
        self.releases.append((release, namespace))
        self.helm(*argv)

    def uninstall(self, release: str, namespace: str) -> None:
        """``helm uninstall --wait`` and the namespace deleted, waited for (its pods gone from the node)."""
        self.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
        self.releases.remove((release, namespace))
        document = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        self.delete(document)
        self.wait_gone(document)


async def in_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a worker thread (the API client blocks)."""
    return await asyncio.to_thread(function, *args)
