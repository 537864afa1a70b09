"""GPUs allocated by DRA: a fake NVIDIA DRA driver on the real kubelet, the real scheduler allocating its devices to
ResourceClaims, and the agent placing the kubelet's device names on its GPUs by NVML identity, with no cluster access.

The agent fakes 12 GPUs. GPUs 0-7 are the session's device plugin's; the DRA driver publishes the other four, named
as NVIDIA's driver (v0.4.1) names them from minor numbers, which count down from the last index here, so no name's
number is its GPU's index: ``gpu-3`` is GPU 8 and ``gpu-2`` GPU 9 (read as indices they would be GPUs 3 and 2, which
another tenant's pod holds through the device plugin for the whole module); GPUs 10 and 11 are in MIG mode with one
instance each, published as ``gpu-1-mig-1g10gb-19-0`` with its UUID and ``gpu-0-mig-3g40gb-9-4`` without one, as
DynamicMIG leaves a device the driver makes on demand. The fake instance exists from the agent's start: an instance
made after the agent enumerated its GPUs is placed at the next enumeration, which the unit tests drive
(``tests/agent/collectors/test_nvml_identity.py``). A claim takes one whole GPU and one MIG device. Debian's
containerd 1.6 does not apply CDI devices, so the containers see none; the pods still start, and attribution comes
from the kubelet's PodResources API, which reports what the driver prepared. Devices shared by ``share_id``
(consumable capacity, a feature gate this cluster leaves off) are tested in-process (``tests/gateway/test_signals.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from e2e.keda.control_plane import Json, namespace
from e2e.keda.scenario import ReplicaHistory, scaled_object
from e2e.node.chart import NAMESPACE, Release, fake_set, install, metric_value, query, wait_scaled_object_ready
from e2e.node.cluster import Deadline, DraHolding, NodeCluster, dra_holdings, eventually, gpu_deployment, in_thread
from e2e.node.conftest import record
from e2e.node.dra_driver import DRIVER, RESOURCE_API, FakeDevice
from e2e.node.node import NODE_NAME
from gpuscaler.client.hpa import MetricType

AGENT_GPUS = 12
TARGET = 60.0
BUSY = 90.0
STEP_TIMEOUT_SECONDS = 180.0
SETTLE_SECONDS = 10.0
WHOLE_CLASS, MIG_CLASS = "gpu.nvidia.com", "mig.nvidia.com"


@dataclass(frozen=True)
class DraGpu:
    """One device the driver publishes and the agent's fake GPU (NVML index and UUID) it names."""

    device: FakeDevice
    index: int  # the NVML index of the GPU (of a MIG device: of its parent)
    nvml_uuid: str  # what the agent reports: the GPU's UUID, or the MIG instance's


def _minor(index: int) -> int:
    """The fake collector's minor number for GPU ``index``: counted down from the last index."""
    return AGENT_GPUS - 1 - index


def _gpu_uuid(index: int) -> str:
    return f"GPU-fake-{NODE_NAME}-{index}"


def _mig_uuid(index: int) -> str:
    """The fake collector's UUID for the first MIG instance of GPU ``index``."""
    return f"MIG-fake-{NODE_NAME}-{index}-0"


def _whole(index: int) -> DraGpu:
    uuid = _gpu_uuid(index)
    return DraGpu(FakeDevice(f"gpu-{_minor(index)}", "gpu", uuid, _minor(index)), index, uuid)


def _mig(index: int, profile: str, profile_id: int, start: int, *, published: bool) -> DraGpu:
    name = f"gpu-{_minor(index)}-mig-{profile.replace('.', '')}-{profile_id}-{start}"
    uuid = _mig_uuid(index)
    device = FakeDevice(name, "mig", uuid if published else None, _minor(index), profile, _gpu_uuid(index))
    return DraGpu(device, index, uuid)


LAYOUT = {
    gpu.device.name: gpu
    for gpu in (
        _whole(8),
        _whole(9),
        _mig(10, "1g.10gb", 19, 0, published=True),
        _mig(11, "3g.40gb", 9, 4, published=False),
    )
}
# The agent's scenario: GPUs 10 and 11 in MIG mode, one instance each, where the driver's names say.
SCENARIO: Json = {
    "gpus": {
        10: {"mig": [{"profile": "1g.10gb", "profile_id": 19, "placement_start": 0}]},
        11: {"mig": [{"profile": "3g.40gb", "profile_id": 9, "placement_start": 4}]},
    }
}


def device_class(name: str, kind: str) -> Json:
    """A DeviceClass as NVIDIA's chart installs it: the driver's devices of one ``type``."""
    selector = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{kind}'"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": selector}}]},
    }


DEVICE_CLASSES = [device_class(WHOLE_CLASS, "gpu"), device_class(MIG_CLASS, "mig")]


def claim_spec(requests: dict[str, str]) -> Json:
    """A claim's spec: one device of each class, by request name."""
    return {"devices": {"requests": [{"name": n, "exactly": {"deviceClassName": c}} for n, c in requests.items()]}}


def claim_template(name: str, ns: str, requests: dict[str, str]) -> Json:
    """A ResourceClaimTemplate: each pod that names it gets its own claim of ``requests``."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"spec": claim_spec(requests)},
    }


def dra_deployment(name: str, ns: str, *, replicas: int, claim: Json) -> Json:
    """A Deployment whose pods hold one DRA claim (``claim``: the pod's resourceClaims entry, without its name) and
    request no nvidia.com/gpu."""
    deployment = gpu_deployment(name, ns, replicas=replicas)
    pod = deployment["spec"]["template"]["spec"]
    pod["resourceClaims"] = [{"name": "gpus", **claim}]
    (container,) = pod["containers"]
    container["resources"] = {"claims": [{"name": "gpus"}]}
    return deployment


OTHER_TENANT = gpu_deployment("other-tenant", "dra-other-tenant", replicas=1, gpus=8)


@pytest.fixture(scope="module")
def dra(chart_cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """The DRA driver and its DeviceClasses, another tenant's pod holding the device plugin's 8 GPUs, and the chart
    with the agent on 12 fake GPUs (two in MIG mode); nothing is set for DRA (``agent.podResources`` is on, and its
    ``draDrivers`` is the driver, by default)."""
    cluster = chart_cluster
    cluster.node.start_dra_driver([gpu.device for gpu in LAYOUT.values()])
    values = tmp_path_factory.mktemp("dra") / "values.yaml"
    values.write_text(yaml.safe_dump({"agent": {"fake": {"gpus": AGENT_GPUS, "scenario": SCENARIO}}}))
    other = namespace(OTHER_TENANT["metadata"]["namespace"])
    try:
        for document in [*DEVICE_CLASSES, other, OTHER_TENANT]:
            cluster.apply(document)
        cluster.wait_running(other["metadata"]["name"], "app=other-tenant", 1)
        release_namespace = namespace(NAMESPACE)
        release_namespace["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "privileged"}
        cluster.apply(release_namespace)
        release = install(cluster, values=[values])
        try:
            release.wait_ready()
            yield release
        finally:
            release.uninstall()
    finally:
        cluster.delete(other)
        cluster.wait_gone(other)
        for document in DEVICE_CLASSES:
            cluster.delete(document)
        cluster.node.stop_dra_driver()


async def _held(ns: str, pods: list[Json]) -> list[DraHolding]:
    """The DRA devices of ``pods`` that the kubelet reports, the driver's only."""
    names = {pod["metadata"]["name"] for pod in pods}
    return [h for h in await dra_holdings() if h.namespace == ns and h.pod in names and h.driver == DRIVER]


def _allocated(cluster: NodeCluster, ns: str, claim: str) -> list[str]:
    """The devices the scheduler allocated to a claim, as the API has them."""
    found = cluster.kube.get(f"{RESOURCE_API}/namespaces/{ns}/resourceclaims/{claim}") or {}
    results = (((found.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return sorted(r["device"] for r in results if r["driver"] == DRIVER and r["pool"] == NODE_NAME)


async def _counted(address: str, asked: dict[str, str]) -> tuple[Json, list[tuple[str, str]]]:
    """A server's answer and the (GPU UUID, ns/pod) pairs it counted, one per pod a GPU was counted for."""
    answer = await query(address, asked)
    gpus = (answer.get("explanation") or {}).get("gpus", [])
    return answer, sorted((g["uuid"], f"{g.get('namespace')}/{g.get('pod')}") for g in gpus if g.get("included"))


async def _wait_counted(address: str, asked: dict[str, str], expected: list[tuple[str, str]]) -> Json:
    """Waits until the server at ``address`` answers GetMetrics (not an error: an error counts nothing too) and counts
    exactly ``expected``; returns the answer."""
    answer, _ = await eventually(
        f"{address} to answer and count exactly {expected} for {asked}",
        60,
        lambda: _counted(address, asked),
        lambda found: bool(found[0]["get_metrics"]["ok"]) and found[1] == sorted(expected),
    )
    return answer


def _pairs(ns: str, holdings: list[DraHolding]) -> list[tuple[str, str]]:
    """The (NVML UUID, ns/pod) pairs a server should count for ``holdings``."""
    return sorted({(LAYOUT[h.device].nvml_uuid, f"{ns}/{h.pod}") for h in holdings})


def _describe(holdings: list[DraHolding]) -> str:
    """Each pod's claim and devices, and the GPU each device is, once each."""
    return ", ".join(
        sorted(
            {
                f"{h.pod} ({h.claim}: {h.device} = GPU {LAYOUT[h.device].index} {LAYOUT[h.device].nvml_uuid})"
                for h in holdings
            }
        )
    )


async def test_keda_scales_a_dra_workload_on_exactly_the_devices_its_claims_hold(dra: Release) -> None:
    """Each pod's claim (from a ResourceClaimTemplate) takes one whole GPU and one MIG device; the gateway's workload
    query counts exactly the NVML devices those names are (``gpu-<minor>`` by minor number, MIG names by profile and
    placement, the one published without a UUID included), the real KEDA and HPA scale 1 -> 2 on them (AverageValue,
    target 60: the first pod's devices at 90, so ceil(90 / 60) = 2, and 90 / (2 x 60) outside the tolerance keeps 2),
    and back to 1 when they idle. The agent itself, asked for the pods by name, lets go of a deleted pod's devices:
    after the scale-in only the survivor's are counted, a pod deleted by hand is replaced by one with a claim of its
    own, and with the Deployment gone nothing is counted and the claims are deleted."""
    cluster = dra.cluster
    ns, app = "dra", "dra-trainer"
    template = claim_template("gpu-and-mig", ns, {"gpu": WHOLE_CLASS, "mig": MIG_CLASS})
    deployment = dra_deployment(app, ns, replicas=1, claim={"resourceClaimTemplateName": "gpu-and-mig"})
    address, agent = await in_thread(dra.service_address), await in_thread(dra.agent_address)
    metadata = {"scalerAddress": address, "workload": app, "metric": "gpu_utilization", "targetValue": f"{TARGET:g}"}
    asked = {**metadata, "namespace": ns}
    # The agent has no pod directory: it selects by pod name, from the kubelet's PodResources alone.
    asked_agent = {"pod": f"{app}-*", "namespace": ns, "metric": "gpu_utilization", "targetValue": f"{TARGET:g}"}
    manifest = scaled_object(
        app, trigger="external", metadata=metadata, metric_type=MetricType.AVERAGE_VALUE, min_replicas=1, max_replicas=3
    )
    manifest["metadata"]["namespace"] = ns
    await in_thread(cluster.apply, namespace(ns))
    try:
        await fake_set(agent, "all", gpu_utilization=0)
        await in_thread(cluster.apply, template)
        await in_thread(cluster.apply, deployment)
        history = ReplicaHistory(cluster.plane, ns, app)
        first = await in_thread(cluster.wait_running, ns, f"app={app}", 1)
        holdings = await _held(ns, first)
        kinds = sorted(LAYOUT[h.device].device.kind for h in holdings)
        assert kinds == ["gpu", "mig"], f"the first pod holds {holdings}"
        (claim,) = {h.claim for h in holdings}
        assert await in_thread(_allocated, cluster, ns, claim) == sorted(h.device for h in holdings)
        for holding in holdings:
            await fake_set(agent, LAYOUT[holding.device].index, gpu_utilization=BUSY)
        answer = await _wait_counted(address, asked, _pairs(ns, holdings))
        assert metric_value(answer) == pytest.approx(BUSY), answer["get_metrics"]

        await in_thread(cluster.apply, manifest)
        await in_thread(wait_scaled_object_ready, cluster, ns, app)
        await history.wait_for(lambda replicas: replicas != 1, STEP_TIMEOUT_SECONDS, "2")
        pods = await in_thread(cluster.wait_running, ns, f"app={app}", 2)
        holdings = await _held(ns, pods)
        # Both pods run: every device the driver publishes is held, the one without a UUID too.
        assert sorted(h.device for h in holdings) == sorted(LAYOUT), holdings
        answer = await _wait_counted(address, asked, _pairs(ns, holdings))
        assert metric_value(answer) == pytest.approx(BUSY), answer["get_metrics"]  # the second pod's devices read 0
        await _wait_counted(agent, asked_agent, _pairs(ns, holdings))
        await history.hold(2, SETTLE_SECONDS)
        assert history.steps == [1, 2], history.describe()
        hpa = await in_thread(
            cluster.kube.get, f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/keda-hpa-{app}"
        )
        assert hpa is not None
        assert hpa["status"]["desiredReplicas"] == 2, hpa["status"]
        scaled_out = _describe(holdings)

        # Idle: back to minReplicaCount; the deleted pod's devices leave the agent's count, not just the gateway's.
        await fake_set(agent, "all", gpu_utilization=0)
        await history.wait_equal(1, STEP_TIMEOUT_SECONDS)
        (survivor,) = await in_thread(cluster.wait_running, ns, f"app={app}", 1)
        remaining = await _held(ns, [survivor])
        assert len(remaining) == 2, remaining
        await _wait_counted(address, asked, _pairs(ns, remaining))
        await _wait_counted(agent, asked_agent, _pairs(ns, remaining))

        # KEDA lets go; a pod deleted by hand is replaced by one with a claim of its own, counted in its place.
        await in_thread(cluster.delete, manifest)
        await in_thread(cluster.wait_gone, manifest)
        await in_thread(cluster.kube.delete, {"apiVersion": "v1", "kind": "Pod", "metadata": survivor["metadata"]})
        replacement = await in_thread(
            cluster.wait_replacement, ns, app, survivor["metadata"]["name"], STEP_TIMEOUT_SECONDS
        )
        replaced = await _held(ns, [replacement])
        assert {h.claim for h in replaced}.isdisjoint({h.claim for h in remaining}), (remaining, replaced)
        await _wait_counted(address, asked, _pairs(ns, replaced))
        await _wait_counted(agent, asked_agent, _pairs(ns, replaced))
        line = (
            f"DRA workload ({ns}/{app}, AverageValue, target {TARGET:g}, max 3): {scaled_out}; the gateway counts "
            f"those 4 devices, value {metric_value(answer):g}; replicas by the real HPA {history.describe()} "
            f"(desiredReplicas {hpa['status']['desiredReplicas']} at 2); after the scale-in and a replacement the "
            f"gateway and the agent count only {_describe(replaced)}"
        )
        print(line)
        record(line)
        history.stop()

        await in_thread(cluster.delete, deployment)
        await in_thread(cluster.wait_running, ns, f"app={app}", 0)
        answer = await _wait_counted(address, asked, [])  # the workload has no pod: a true 0
        assert metric_value(answer) == 0.0, answer["get_metrics"]
        # The agent holds no device for any of them: on one node it cannot tell "none here" from "elsewhere", so it
        # says so rather than 0.
        await eventually(
            "the agent to see no pod of the workload holding a GPU",
            60,
            lambda: query(agent, asked_agent),
            lambda found: (
                found["get_metrics"]["code"] == "FAILED_PRECONDITION"
                and "holds a GPU on node" in found["get_metrics"]["message"]
            ),
        )
        assert await _held(ns, [replacement]) == []
        await in_thread(_wait_no_claims, cluster, ns)
    finally:
        await in_thread(cluster.delete, manifest)
        await in_thread(cluster.delete, deployment)
        await in_thread(cluster.wait_running, ns, f"app={app}", 0)
        await in_thread(cluster.delete, template)
        await in_thread(cluster.delete, namespace(ns))
        await in_thread(cluster.wait_gone, namespace(ns))


async def test_pods_sharing_one_claim_count_the_gpu_they_share(dra: Release) -> None:
    """Two pods name one ResourceClaim (one whole GPU): the kubelet reports the same device for both, and the gateway
    counts that GPU once for each pod, the whole GPU for each (no per-process reads), as it counts time-sliced
    replicas: 2 x 70 = 140."""
    cluster = dra.cluster
    ns, app = "dra-shared", "shared"
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "one-gpu", "namespace": ns},
        "spec": claim_spec({"gpu": WHOLE_CLASS}),
    }
    deployment = dra_deployment(app, ns, replicas=2, claim={"resourceClaimName": "one-gpu"})
    address, agent = await in_thread(dra.service_address), await in_thread(dra.agent_address)
    asked = {"scalerAddress": address, "workload": app, "metric": "gpu_utilization", "namespace": ns}
    await in_thread(cluster.apply, namespace(ns))
    try:
        await fake_set(agent, "all", gpu_utilization=0)
        await in_thread(cluster.apply, claim)
        await in_thread(cluster.apply, deployment)
        pods = await in_thread(cluster.wait_running, ns, f"app={app}", 2)
        holdings = await _held(ns, pods)
        # The kubelet (1.36.3) prepares a shared claim once per pod and lists its device once per preparation in
        # each pod's entry: what counts is which devices each pod holds.
        (device,) = {h.device for h in holdings}
        held = {(h.pod, h.claim, h.device) for h in holdings}
        assert held == {(pod["metadata"]["name"], "one-gpu", device) for pod in pods}, holdings
        gpu = LAYOUT[device]
        assert gpu.device.kind == "gpu", holdings
        await fake_set(agent, gpu.index, gpu_utilization=70)
        pairs = [(gpu.nvml_uuid, f"{ns}/{pod['metadata']['name']}") for pod in pods]  # once for each pod
        answer = await _wait_counted(address, asked, pairs)
        assert metric_value(answer) == pytest.approx(140.0), answer["get_metrics"]
        record(f"DRA sharing: {_describe(holdings)}; the gateway counts {gpu.nvml_uuid} for each, value 140")
    finally:
        await in_thread(cluster.delete, deployment)
        await in_thread(cluster.wait_running, ns, f"app={app}", 0)
        await in_thread(cluster.delete, claim)
        await in_thread(cluster.delete, namespace(ns))
        await in_thread(cluster.wait_gone, namespace(ns))


def _wait_no_claims(cluster: NodeCluster, ns: str) -> None:
    """Waits until the resourceclaim controller has deleted the claims it made for the namespace's pods."""
    Deadline(f"the claims in {ns} to go", STEP_TIMEOUT_SECONDS).until(
        lambda: cluster.kube.request("GET", f"{RESOURCE_API}/namespaces/{ns}/resourceclaims")["items"],
        lambda items: not items,
        cluster.check_alive,
    )
