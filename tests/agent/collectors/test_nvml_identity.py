"""NvmlCollector's device facts against a fake pynvml: minor numbers, MIG placements, dynamic MIG, refusals."""

from __future__ import annotations

import pytest

from gpuscaler.agent.attribution.devices import Assignment, device_plugin_name, dra_name, place
from gpuscaler.agent.collectors.base import CollectorUnavailable
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.samples import PodRef
from tests.fakes.fake_nvml import FUNCTION_NOT_FOUND, GPU_IS_LOST, NOT_SUPPORTED, FakeDevice, FakeNvml

NO_PERMISSION = 4  # NVML_ERROR_NO_PERMISSION: reading a GPU instance needs a privileged user


def started(nvml: FakeNvml) -> NvmlCollector:
    """An opened NvmlCollector on node-a over the fake ``nvml``."""
    collector = NvmlCollector(node="node-a", nvml=nvml)
    collector.open()
    return collector


def mig(uuid: str, gpu_instance_id: int, profile_id: int, start: int) -> FakeDevice:
    """A MIG instance in GPU instance ``gpu_instance_id`` with that profile id and placement start."""
    return FakeDevice(
        uuid,
        name="NVIDIA H100 1g.10gb",
        gpu_instance_id=gpu_instance_id,
        gi_profile_id=profile_id,
        placement_start=start,
    )


def test_each_gpu_carries_its_minor_number_not_its_index() -> None:
    """A GPU's identity has NVML's minor number, which differs from its index when the GPUs were renumbered."""
    collector = started(FakeNvml([FakeDevice("GPU-a", minor=2), FakeDevice("GPU-b", minor=0), FakeDevice("GPU-c")]))

    assert [(d.index, d.uuid, d.minor) for d in collector.discover()] == [
        (0, "GPU-a", 2),
        (1, "GPU-b", 0),
        (2, "GPU-c", 2),
    ]


def test_mig_instances_carry_parent_minor_profile_and_placement() -> None:
    """Each MIG instance has its parent's minor number and its own GPU instance's id, profile id and placement."""
    parent = FakeDevice("GPU-p", minor=3, mig_instances=[mig("MIG-x", 1, 19, 6), None, mig("MIG-y", 2, 14, 0)])
    collector = started(FakeNvml([FakeDevice("GPU-plain", minor=5), parent]))

    devices = collector.discover()

    assert [
        (d.uuid, d.index, d.minor, d.gpu_instance_id, d.gpu_instance_profile_id, d.placement_start) for d in devices
    ] == [
        ("GPU-plain", 0, 5, None, None, None),
        ("MIG-x", 1, 3, 1, 19, 6),
        ("MIG-y", 1, 3, 2, 14, 0),
    ]


def test_facts_are_read_once_per_device_not_per_discovery() -> None:
    """Rediscovery keeps the facts it read: NVML is asked once per GPU and once per MIG instance."""
    nvml = FakeNvml([FakeDevice("GPU-a", minor=1), FakeDevice("GPU-p", mig_instances=[mig("MIG-x", 1, 19, 0)])])
    collector = started(nvml)

    first = collector.discover()
    second = collector.discover()

    assert [(d.minor, d.placement_start) for d in second] == [(d.minor, d.placement_start) for d in first]
    assert nvml.calls["nvmlDeviceGetMinorNumber"] == 2
    assert nvml.calls["nvmlGpuInstanceGetInfo"] == 1


def test_dynamic_mig_instance_is_placed_at_the_next_discovery() -> None:
    """A MIG instance made while the agent runs (a DRA driver's dynamic MIG) is enumerated with its placement."""
    nvml = FakeNvml([FakeDevice("GPU-p", minor=4, mig_instances=[mig("MIG-old", 1, 19, 0), None])])
    collector = started(nvml)
    assert [d.uuid for d in collector.discover()] == ["MIG-old"]

    nvml.create_mig(0, mig("MIG-new", 7, 15, 4))

    placed = {d.uuid: (d.minor, d.gpu_instance_profile_id, d.placement_start) for d in collector.discover()}
    assert placed == {"MIG-old": (4, 19, 0), "MIG-new": (4, 15, 4)}


@pytest.mark.parametrize("code", [NOT_SUPPORTED, FUNCTION_NOT_FOUND])
def test_facts_nvml_does_not_give_are_none(code: int) -> None:
    """A driver without the minor number or GPU instance calls leaves those facts None, and the devices are listed."""
    instance = mig("MIG-x", 1, 19, 0)
    instance.errors["nvmlGpuInstanceGetInfo"] = code
    parent = FakeDevice("GPU-p", errors={"nvmlDeviceGetMinorNumber": code}, mig_instances=[instance])
    collector = started(FakeNvml([parent]))

    [device] = collector.discover()

    assert (device.uuid, device.minor, device.gpu_instance_profile_id, device.placement_start) == (
        "MIG-x",
        None,
        None,
        None,
    )


def test_other_failure_of_a_fact_is_a_failed_discovery() -> None:
    """A GPU lost while its minor number is read fails the discovery, as a lost GPU during enumeration does."""
    collector = started(FakeNvml([FakeDevice("GPU-a", errors={"nvmlDeviceGetMinorNumber": GPU_IS_LOST})]))

    with pytest.raises(CollectorUnavailable, match="GPU is lost"):
        collector.discover()


def test_a_refused_minor_number_leaves_the_gpu_listed_and_its_minor_names_unplaced() -> None:
    """NO_PERMISSION on the minor number lists the GPU with none: a gpu-<minor> name is unplaced, its UUID still
    places."""
    refused = FakeDevice("GPU-a", minor=1, errors={"nvmlDeviceGetMinorNumber": NO_PERMISSION})
    devices = list(started(FakeNvml([FakeDevice("GPU-plain", minor=0), refused])).discover())

    assert [(d.uuid, d.minor) for d in devices] == [("GPU-plain", 0), ("GPU-a", None)]
    pod = PodRef("ml", "p", "c")
    by_minor = dra_name("gpu.nvidia.com", "gpu-1")
    by_uuid = device_plugin_name("nvidia.com/gpu", "GPU-a")
    assert by_minor is not None
    assert by_uuid is not None
    placed = place(
        devices,
        [Assignment(pod, "gpu.nvidia.com", "gpu-1", by_minor), Assignment(pod, "nvidia.com/gpu", "GPU-a", by_uuid)],
    )
    assert placed.pods == {"GPU-a": (pod,)}
    assert [u.device for u in placed.unplaced] == ["gpu.nvidia.com device 'gpu-1'"]


def test_refused_mig_placement_leaves_gpus_listed_and_names_unplaced_with_the_reason() -> None:
    """An agent without privilege (NO_PERMISSION on the GPU instance) still lists every GPU; a DRA MIG name says why."""
    parent = FakeDevice(
        "GPU-p",
        minor=3,
        errors={"nvmlDeviceGetGpuInstanceById": NO_PERMISSION},
        mig_instances=[mig("MIG-x", 1, 19, 0)],
    )
    collector = started(FakeNvml([FakeDevice("GPU-plain", minor=0), parent]))

    devices = list(collector.discover())

    assert [(d.uuid, d.gpu_instance_profile_id, d.placement_start) for d in devices] == [
        ("GPU-plain", None, None),
        ("MIG-x", None, None),
    ]
    named = dra_name("gpu.nvidia.com", "gpu-3-mig-1g10gb-19-0")
    assert named is not None
    placed = place(devices, [Assignment(PodRef("ml", "p", "c"), "gpu.nvidia.com", "gpu-3-mig-1g10gb-19-0", named)])
    assert placed.pods == {}
    [unplaced] = placed.unplaced
    assert "NVML refused to read MIG placement" in unplaced.detail
    assert "NVML error 4" in unplaced.detail


def test_refused_mig_placement_keeps_the_gpu_instance_id_that_places_gke_names() -> None:
    """Without privilege the GPU instance id is still read, so GKE's nvidia<minor>/gi<id> name is placed."""
    parent = FakeDevice(
        "GPU-p",
        minor=3,
        errors={"nvmlDeviceGetGpuInstanceById": NO_PERMISSION},
        mig_instances=[mig("MIG-x", 1, 19, 0), mig("MIG-y", 4, 19, 1)],
    )
    devices = list(started(FakeNvml([parent])).discover())

    assert [(d.uuid, d.gpu_instance_id, d.gpu_instance_profile_id) for d in devices] == [
        ("MIG-x", 1, None),
        ("MIG-y", 4, None),
    ]
    named = device_plugin_name("nvidia.com/gpu", "nvidia3/gi4/vgpu0")
    assert named is not None
    placed = place(devices, [Assignment(PodRef("ml", "p", "c"), "nvidia.com/gpu", "nvidia3/gi4/vgpu0", named)])
    assert placed.pods == {"MIG-y": (PodRef("ml", "p", "c"),)}


def test_gpu_lost_while_reading_a_mig_placement_fails_the_discovery() -> None:
    """A GPU gone while its GPU instance is read fails the discovery, as any device lost during enumeration does."""
    parent = FakeDevice(
        "GPU-p", errors={"nvmlDeviceGetGpuInstanceById": GPU_IS_LOST}, mig_instances=[mig("MIG-x", 1, 19, 0)]
    )
    collector = started(FakeNvml([parent]))

    with pytest.raises(CollectorUnavailable, match="GPU is lost"):
        collector.discover()
