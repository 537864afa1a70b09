"""A gateway reads the devices an agent could not place from its snapshot, and a workload over one is unknown."""

from __future__ import annotations

import pytest

from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.errors import Unavailable
from gpuscaler.model.pods import PodInfo
from gpuscaler.model.samples import Attribution, AttributionState, PodRef, ReadErrorKind, UnplacedDevice
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.server.wire import snapshot_to_wire
from gpuscaler.signals.evaluation import evaluate
from tests.builders import cluster, decoded, gpu_sample, gpu_trigger, snapshot, source_of
from tests.signals.test_evaluation_workloads import Directory

MIG = "gpu.nvidia.com device 'gpu-0-mig-1g10gb-19-0'"


def agent_message(*unplaced: pb.UnplacedDevice) -> pb.Snapshot:
    """Node node-a's snapshot as its agent sends it: trainer-a holds GPU 0, and the agent lists ``unplaced``."""
    sample = gpu_sample(0, util=40.0, pods=(PodRef("ml", "trainer-a", "main"),), node="node-a", uuid="GPU-a-0")
    message = snapshot_to_wire(snapshot(1, 0.0, (sample,), node="node-a"), poll_interval_seconds=1.0)
    message.attribution = pb.Attribution(state=pb.AttributionState.OK, unplaced=list(unplaced))
    return message


def test_unplaced_devices_are_read_with_their_pod_kind_and_reason() -> None:
    """Each device keeps its pod, name, kind and reason; a kind this version does not know reads as OTHER."""
    message = agent_message(
        pb.UnplacedDevice(pb.PodRef("ml", "trainer-b", "main"), MIG, pb.ReadErrorKind.OTHER, "no MIG instance"),
        pb.UnplacedDevice(
            pb.PodRef("vm", "guest", "main"), "gpu.nvidia.com device 'gpu-vfio-0'", pb.ReadErrorKind.NOT_SUPPORTED, "vm"
        ),
        pb.UnplacedDevice(pb.PodRef("ml", "trainer-c", "main"), "x", pb.ReadErrorKind.UNSPECIFIED, "?"),
    )

    attribution = decoded(message).attribution

    assert attribution == Attribution(
        AttributionState.OK,
        "",
        (
            UnplacedDevice(PodRef("ml", "trainer-b", "main"), MIG, ReadErrorKind.OTHER, "no MIG instance"),
            UnplacedDevice(
                PodRef("vm", "guest", "main"), "gpu.nvidia.com device 'gpu-vfio-0'", ReadErrorKind.NOT_SUPPORTED, "vm"
            ),
            UnplacedDevice(PodRef("ml", "trainer-c", "main"), "x", ReadErrorKind.OTHER, "?"),
        ),
    )
    assert decoded(agent_message()).attribution == Attribution(AttributionState.OK)


def test_a_workload_over_a_device_its_agent_could_not_place_is_unavailable_naming_it() -> None:
    """The gateway's workload answer is UNAVAILABLE, naming the pod and the device, not the sum without it."""
    message = agent_message(
        pb.UnplacedDevice(pb.PodRef("ml", "trainer-b", "main"), MIG, pb.ReadErrorKind.OTHER, "no MIG instance")
    )
    directory = Directory(*(PodInfo("ml", name, {}, "trainer", "Deployment") for name in ("trainer-a", "trainer-b")))
    query = gpu_trigger(parse_metadata({"workload": "trainer"}, Limits(history_seconds=600), namespace="ml"))

    answer = evaluate(query.value, source_of(cluster(decoded(message))), now=0.0, stale_after=5.0, directory=directory)

    assert isinstance(answer.error, Unavailable)
    assert f"unplaced {MIG}" in answer.error.message
    assert "pod ml/trainer-b holds it" in answer.error.message
    assert answer.value is None
    tolerant = gpu_trigger(
        parse_metadata({"workload": "trainer", "maxUnreadable": "1"}, Limits(history_seconds=600), namespace="ml")
    )
    assert evaluate(
        tolerant.value, source_of(cluster(decoded(message))), now=0.0, stale_after=5.0, directory=directory
    ).value == pytest.approx(40.0)
