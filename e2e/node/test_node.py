"""The node itself: the kubelet registers a Ready node, the fake device plugin's GPUs become allocatable, and pods
that request them really run, holding exactly the devices the kubelet's PodResources API reports."""

from __future__ import annotations

import re

from e2e.node.cluster import GPU_RESOURCE, Holding, NodeCluster, eventually, gpu_deployment, in_thread, pod_resources
from e2e.node.conftest import FAKE_GPUS, record
from e2e.node.device_plugin import fake_gpu_uuid


def test_the_node_is_ready_with_the_fake_gpus_allocatable(cluster: NodeCluster) -> None:
    """The Node is Ready and offers one nvidia.com/gpu per fake GPU."""
    assert cluster.node.ready()
    assert cluster.node.allocatable(GPU_RESOURCE) == str(FAKE_GPUS)


async def test_gpu_pods_run_and_hold_the_devices_the_kubelet_reports(cluster: NodeCluster) -> None:
    """Two busybox pods of one GPU each start; each container got its GPU's UUID from Allocate, the kubelet's
    PodResources lists the same, no GPU twice; deleted, they leave PodResources."""
    namespace = "node-gpu-pods"
    await in_thread(cluster.apply, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    workload = gpu_deployment("holder", namespace, replicas=2)
    await in_thread(cluster.apply, workload)
    pods = await in_thread(cluster.wait_running, namespace, "app=holder", 2)
    names = {pod["metadata"]["name"] for pod in pods}
    uuids = {fake_gpu_uuid(cluster.node.name, index) for index in range(FAKE_GPUS)}

    held = [h for h in await pod_resources() if h.namespace == namespace and h.resource == GPU_RESOURCE]
    assert {h.pod for h in held} == names, held
    devices = [device for h in held for device in h.device_ids]
    assert len(set(devices)) == len(devices) == 2, held
    assert set(devices) <= uuids, held
    for holding in held:
        log = await in_thread(cluster.log, namespace, holding.pod)
        assert re.search(rf"^gpus={re.escape(holding.device_ids[0])}$", log, re.MULTILINE), log
    record(f"gpu pods: {sorted(names)} held {sorted(devices)}")

    await in_thread(cluster.delete, workload)

    async def ours() -> list[Holding]:
        return [h for h in await pod_resources() if h.namespace == namespace]

    await eventually("the deleted pods to leave the kubelet's PodResources", 120, ours, lambda found: not found)
