"""The chart installed on the node with helm, as a user installs it, and what the suite adds for a node without a GPU.

``BASE_SETS`` is everything the suite sets on top of a values file: the fake collector (there is no GPU here) and
``imagePullPolicy: Never`` (the image was imported; there is no registry). The node carries the GPU node label GPU
feature discovery would set, and a RuntimeClass ``nvidia`` whose handler is runc, as the GPU operator installs one
(containerd's ``nvidia`` runtime is plain runc here). Everything else comes from the chart's own files.
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.keda.control_plane import Json
from e2e.node.cluster import (
    CHART,
    GPU_RESOURCE,
    Deadline,
    Holding,
    NodeCluster,
    condition,
    eventually,
    in_thread,
    pod_resources,
)
from e2e.node.node import NVIDIA_RUNTIME
from e2e.support.agent import CONSOLE_SCRIPT
from e2e.support.clients import query_json
from tests.chart import chart_tools
from tests.tools import locate

CI_VALUES = CHART / "ci"
EXAMPLES = CHART / "examples"
RELEASE = "gpuscaler"
NAMESPACE = "gpuscaler"
BASE_SETS = {"agent.collector": "fake", "image.pullPolicy": "Never"}
GPU_NODE_LABEL = ("nvidia.com/gpu.present", "true")
READY_TIMEOUT_SECONDS = 180.0
RUNTIME_CLASS: Json = {
    "apiVersion": "node.k8s.io/v1",
    "kind": "RuntimeClass",
    "metadata": {"name": NVIDIA_RUNTIME},
    "handler": NVIDIA_RUNTIME,
}


def monitoring_crds() -> list[Json]:
    """prometheus-operator's ServiceMonitor and PrometheusRule CRDs, from the module the chart tests pin (``python -m
    e2e.node``'s setup step fetches it into the Go module cache before the namespaces cut the network off)."""
    crds: list[Json] = []
    for module, version, path in chart_tools.CRDS:
        if "prometheus-operator" in module:
            crds.append(yaml.safe_load((locate(chart_tools.ModuleSource(module, version)) / path).read_text()))
    return crds


@dataclass
class Release:
    """One helm release of the chart and its pods."""

    cluster: NodeCluster
    name: str = RELEASE
    namespace: str = NAMESPACE

    def _selector(self, component: str) -> str:
        return f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}"

    def agent_pods(self) -> list[Json]:
        return self.cluster.pods(self.namespace, self._selector("agent"))

    def gateway_pods(self) -> list[Json]:
        return self.cluster.pods(self.namespace, self._selector("gateway"))

    def gateway_replicas(self) -> int:
        """The gateway Deployment's replicas (0 when the release renders none)."""
        found = self.cluster.kube.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.name}-gateway")
        return int((found or {}).get("spec", {}).get("replicas", 0))

    def wait_ready(self, timeout: float = READY_TIMEOUT_SECONDS) -> tuple[list[Json], list[Json]]:
        """Waits until the one agent pod (one node) and every gateway replica are Running and Ready."""
        expected = self.gateway_replicas()

        def probe() -> tuple[list[Json], list[Json]]:
            return self.agent_pods(), self.gateway_pods()

        def accept(found: tuple[list[Json], list[Json]]) -> bool:
            agents, gateways = found
            return len(agents) == 1 and len(gateways) == expected and all(_ready(pod) for pod in [*agents, *gateways])

        what = f"release {self.name}: 1 agent and {expected} gateway pod(s) Ready"

        def check() -> None:
            self.cluster.check_alive()
            # A container the runtime failed to start three times will not start: say so now, not at the deadline.
            for pod in [*self.agent_pods(), *self.gateway_pods()]:
                for container in pod.get("status", {}).get("containerStatuses", []):
                    last = (container.get("lastState") or {}).get("terminated") or {}
                    if last.get("reason") == "StartError" and int(container.get("restartCount", 0)) >= 2:
                        raise AssertionError(f"{what}: {pod['metadata']['name']} cannot start")

        try:
            return Deadline(what, timeout).until(probe, accept, check)
        except AssertionError as error:
            first = str(error).splitlines()[0][:300]
            raise AssertionError(f"{first}\n{self.cluster.describe_pods(self.namespace)}") from None

    def service_address(self) -> str:
        """What KEDA's scalerAddress names: <fullname>.<namespace>.svc.cluster.local:<port> of the scaler Service."""
        service = self.cluster.kube.get(f"/api/v1/namespaces/{self.namespace}/services/{self.name}")
        assert service is not None, f"the release renders no Service {self.name}"
        port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        return f"{self.name}.{self.namespace}.svc.cluster.local:{port}"

    def agent_address(self) -> str:
        """The agent pod's IP and gRPC port (its fake-control API is there)."""
        (pod,) = self.agent_pods()
        port = next(
            p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if p["name"] == "grpc"
        )
        return f"{pod['status']['podIP']}:{port}"

    def uninstall(self) -> None:
        self.cluster.uninstall(self.name, self.namespace)


def _ready(pod: Json) -> bool:
    return (
        not pod["metadata"].get("deletionTimestamp")
        and pod.get("status", {}).get("phase") == "Running"
        and condition(pod, "Ready") == "True"
    )


def install(
    cluster: NodeCluster, values: list[Path] | None = None, sets: dict[str, str] | None = None, **kwargs: Any
) -> Release:
    """Installs the chart with ``values`` files, BASE_SETS and ``sets`` (later ones win)."""
    release = Release(cluster, **kwargs)
    cluster.install(release.name, release.namespace, values=values or [], sets={**BASE_SETS, **(sets or {})})
    return release


async def query(address: str, metadata: dict[str, str], *, scaled_object: str | None = None) -> Json:
    """``gpuscaler query --output json`` against ``address``: the four RPCs as KEDA makes them, and Explain."""
    return await query_json(address, metadata, scaled_object=scaled_object)


async def fake_set(address: str, gpu: int | str, **values: float) -> None:
    """``gpuscaler fake set`` on an agent pod, as a user types it."""
    argv = [str(CONSOLE_SCRIPT), "fake", "set", "--address", address, "--gpu", str(gpu)]
    argv += [f"{key}={value:g}" for key, value in values.items()]
    result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}{result.stderr}"


def counted_gpus(answer: Json) -> dict[str, str]:
    """The GPUs an answer's explanation counted, by UUID, with the pod each was counted for ("" for none)."""
    gpus = (answer.get("explanation") or {}).get("gpus", [])
    return {
        gpu["uuid"]: f"{gpu.get('namespace', '')}/{gpu.get('pod', '')}".strip("/")
        for gpu in gpus
        if gpu.get("included")
    }


def uuid_index(uuid: str) -> int:
    """The fake GPU's index in its UUID (GPU-fake-<node>-<index>, and ::<n> for a time-sliced replica)."""
    return int(uuid.split("::")[0].rsplit("-", 1)[1])


async def held(cluster: NodeCluster, namespace_name: str, app: str, pods: list[Json] | None = None) -> dict[str, str]:
    """The GPUs the kubelet reports for ``pods`` (default: every pod of Deployment ``app`` now), by UUID (a
    time-sliced replica as its GPU), to ns/pod."""
    if pods is None:
        pods = await in_thread(cluster.pods, namespace_name, f"app={app}")
    names = {pod["metadata"]["name"] for pod in pods}
    holdings: list[Holding] = await pod_resources()
    return {
        device.split("::")[0]: f"{h.namespace}/{h.pod}"
        for h in holdings
        if h.namespace == namespace_name and h.pod in names and h.resource == GPU_RESOURCE
        for device in h.device_ids
    }


async def wait_counted(
    cluster: NodeCluster, address: str, metadata: dict[str, str], expected: dict[str, str] | tuple[str, str]
) -> tuple[Json, dict[str, str]]:
    """Waits until the gateway's answer for ``metadata`` counts exactly ``expected`` (uuid -> ns/pod), or, given
    (namespace, app), exactly what the kubelet reports for that Deployment's pods at the time; returns the answer
    and the GPUs."""

    async def ask() -> tuple[Json, dict[str, str]]:
        wanted = expected if isinstance(expected, dict) else await held(cluster, *expected)
        return await query(address, metadata), wanted

    return await eventually(
        f"the gateway to count exactly the GPUs of {expected} for {metadata}",
        60,
        ask,
        lambda found: counted_gpus(found[0]) == found[1],
    )


def metric_value(answer: Json) -> float:
    """The value an answer's GetMetrics returned; fails the test if GetMetrics failed."""
    metrics = answer["get_metrics"]
    assert metrics["ok"], f"GetMetrics failed: {metrics}"
    return float(metrics["fields"]["metricValues"][0]["metricValueFloat"])


def wait_scaled_object_ready(cluster: NodeCluster, ns: str, name: str) -> Json:
    """Waits until KEDA makes ScaledObject ``ns/name`` Ready, and checks that it made its HPA."""
    path = f"/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects/{name}"

    def ready(found: Json | None) -> bool:
        conditions = ((found or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    found = Deadline(f"ScaledObject {ns}/{name} Ready", 60).until(
        lambda: cluster.kube.get(path), ready, cluster.check_alive
    )
    assert found is not None
    hpa = cluster.kube.get(f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/keda-hpa-{name}")
    assert hpa is not None, f"KEDA made no HPA for {name}: {found.get('status')}"
    return found
