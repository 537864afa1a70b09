"""The dev stack's fake kubelet (dev/fake_kubelet.py): its file's strict reading, its DRA devices reaching an agent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.server import Server

from gpuscaler.generated import v1 as kubelet
from gpuscaler.generated.gpuscaler import v1 as pb
from tests import dev_scripts
from tests.conftest import StartAgent
from tests.fakes.fake_kubelet import short_socket_path

FAKE_KUBELET: Any = dev_scripts.load("fake_kubelet")
NODE = "test-node"  # the node of start_agent's fake GPUs, whose UUIDs are GPU-fake-test-node-<index>


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param(
            "nodes: {n: {ml/a: {gpus: [0], dras: [gpu-0]}}}",
            "f.yaml: nodes.n.ml/a: expected the keys 'gpus' (GPU indices) and/or 'dra' (DRA device names), "
            "got ['dras', 'gpus']",
            id="unknown-key",
        ),
        pytest.param(
            "nodes: {n: {ml/a: {}}}",
            "f.yaml: nodes.n.ml/a: expected the keys 'gpus' (GPU indices) and/or 'dra' (DRA device names), got []",
            id="empty-mapping",
        ),
        pytest.param(
            "nodes: {n: {ml/a: {dra: [gpu-00]}}}",
            "f.yaml: nodes.n.ml/a.dra: 'gpu-00' is not a DRA device name: expected gpu-<minor>, "
            "gpu-<minor>-mig-<profile>-<profileId>-<placement> or gpu-vfio-<index>",
            id="leading-zero",
        ),
        pytest.param(
            "nodes: {n: {ml/a: {dra: [GPU-fake-n-0]}}}",
            "f.yaml: nodes.n.ml/a.dra: 'GPU-fake-n-0' is not a DRA device name",
            id="a-uuid-is-a-device-plugin-id",
        ),
        pytest.param(
            "nodes: {n: {ml/a: {dra: [3]}}}", "f.yaml: nodes.n.ml/a.dra: 3 is not a DRA device name", id="a-number"
        ),
        pytest.param(
            "nodes: {n: {ml/a: {dra: gpu-0}}}",
            "f.yaml: nodes.n.ml/a.dra: expected a list of DRA device names (gpu-<minor>, ",
            id="not-a-list",
        ),
        pytest.param(
            "nodes: {n: {ml/a: {gpus: [-1]}}}",
            "f.yaml: nodes.n.ml/a.gpus: expected a list of GPU indices (whole numbers from 0), got [-1]",
            id="negative-index",
        ),
        pytest.param(
            "nodes: {n: {ml/a: [true]}}",
            "f.yaml: nodes.n.ml/a: expected a list of GPU indices (whole numbers from 0), got [True]",
            id="a-boolean-index",
        ),
        pytest.param(
            "nodes: {n: {ml/a: gpu-0}}",
            "f.yaml: nodes.n.ml/a: expected a list of GPU indices or a mapping with 'gpus' and/or 'dra', got 'gpu-0'",
            id="a-bare-name",
        ),
        pytest.param("nodes: {n: {a: [0]}}", "f.yaml: nodes.n.a: use NAMESPACE/POD", id="no-namespace"),
    ],
)
def test_a_wrong_entry_is_refused_naming_the_node_the_pod_the_value_and_what_is_allowed(text: str, said: str) -> None:
    """Each wrong entry stops the file's reading with a message that names where it is, what it got and what fits."""
    with pytest.raises(FAKE_KUBELET.AssignmentError) as raised:
        FAKE_KUBELET.parse_assignments(text, "f.yaml")
    assert str(raised.value).startswith(said)


def test_both_forms_read_the_plain_list_as_device_plugin_gpus() -> None:
    """A plain list and a mapping read alike for GPU indices; the mapping adds DRA names, MIG and vfio forms too."""
    nodes = FAKE_KUBELET.parse_assignments(
        "nodes:\n  n:\n    ml/a: [0, 1]\n    ml/b: {gpus: [2], dra: [gpu-0, gpu-1-mig-1g10gb-19-0, gpu-vfio-4]}\n", "f"
    )
    held = FAKE_KUBELET.Held
    assert nodes == {
        "n": {
            ("ml", "a"): held(gpus=(0, 1)),
            ("ml", "b"): held(gpus=(2,), dra=("gpu-0", "gpu-1-mig-1g10gb-19-0", "gpu-vfio-4")),
        }
    }


@pytest.fixture
async def dev_kubelet(tmp_path: Path) -> AsyncIterator[Path]:
    """The dev fake kubelet serving one node's socket from a file: a plain pod, a pod with a GPU and a DRA GPU."""
    assignments = tmp_path / "kubelet.yaml"
    assignments.write_text(f"nodes:\n  {NODE}:\n    ml/plain: [0]\n    ml/both: {{gpus: [1], dra: [gpu-0]}}\n")
    socket = short_socket_path()
    server = Server([FAKE_KUBELET.NodeKubelet(NODE, FAKE_KUBELET.Assignments(assignments))])
    await server.start(path=str(socket))
    yield socket
    server.close()
    await server.wait_closed()
    socket.unlink(missing_ok=True)


async def test_dra_devices_are_a_claim_of_the_nvidia_driver_in_the_node_s_pool(dev_kubelet: Path) -> None:
    """``dra`` names come as one claim, ``<pod>-gpu`` in the pod's namespace, driver gpu.nvidia.com, pool the node."""
    channel = Channel(path=str(dev_kubelet))
    try:
        answer = await kubelet.PodResourcesListerStub(channel).list(kubelet.ListPodResourcesRequest())
    finally:
        channel.close()
    both = next(pod for pod in answer.pod_resources if pod.name == "both")
    (container,) = both.containers
    assert [d.device_ids for d in container.devices] == [[f"GPU-fake-{NODE}-1"]]
    assert container.dynamic_resources == [
        kubelet.DynamicResource(
            claim_name="both-gpu",
            claim_namespace="ml",
            claim_resources=[
                kubelet.ClaimResource(
                    cdi_devices=[kubelet.CdiDevice(name="k8s.gpu.nvidia.com/claim=both-gpu-gpu-0")],
                    driver_name="gpu.nvidia.com",
                    pool_name=NODE,
                    device_name="gpu-0",
                )
            ],
        )
    ]


async def test_an_agent_places_the_dra_gpu_by_its_minor_number(start_agent: StartAgent, dev_kubelet: Path) -> None:
    """A real agent over 4 fake GPUs reads the dev kubelet: gpu-0 is the GPU whose minor number is 0, index 3."""
    agent = await start_agent("--poll-interval", "0.1", "--pod-resources-socket", str(dev_kubelet))
    channel = Channel("127.0.0.1", agent.port)
    try:
        snapshot = await pb.AgentStub(channel).get_snapshot(pb.GetSnapshotRequest())
    finally:
        channel.close()
    assert snapshot.attribution is not None
    assert snapshot.attribution.state is pb.AttributionState.OK
    assert not snapshot.attribution.unplaced
    assert [[p.pod for p in gpu.pods] for gpu in snapshot.gpus] == [["plain"], ["both"], [], ["both"]]
