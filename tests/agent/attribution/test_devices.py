"""Kubelet device names map to the GPUs NVML enumerates (through a fake NVML), strictly, or are unplaced."""

from __future__ import annotations

import pytest

from gpuscaler.agent.attribution.devices import (
    VFIO_DETAIL,
    Assignment,
    DeviceKey,
    Named,
    Unplaceable,
    device_plugin_name,
    dra_name,
    place,
)
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.samples import GpuIdentity, PodRef, ReadErrorKind, UnplacedDevice
from tests.fakes.fake_nvml import FakeDevice, FakeNvml

POD = PodRef("ml", "infer-0", "main")
OTHER = PodRef("ml", "infer-1", "main")


def node_nvml() -> FakeNvml:
    """GPU 0 is /dev/nvidia1 and GPU 1 /dev/nvidia0 (renumbered); GPU 2 (/dev/nvidia3) is in MIG mode."""
    return FakeNvml(
        [
            FakeDevice("GPU-aaa", minor=1),
            FakeDevice("GPU-bbb", minor=0),
            FakeDevice(
                "GPU-ccc",
                minor=3,
                mig_instances=[
                    FakeDevice("MIG-x", gpu_instance_id=1, gi_profile_id=19, placement_start=0),
                    None,
                    FakeDevice("MIG-y", gpu_instance_id=2, gi_profile_id=14, placement_start=2),
                ],
            ),
        ]
    )


def enumerated(nvml: FakeNvml) -> list[GpuIdentity]:
    """The identities the NVML collector enumerates over ``nvml``."""
    collector = NvmlCollector(node="n", nvml=nvml)
    collector.open()
    return list(collector.discover())


def placed_as(devices: list[GpuIdentity], named: Named | None, *, source: str = "gpu.nvidia.com") -> str | None:
    """The UUID ``named`` lands on among ``devices``, or None when it is unplaced."""
    assert named is not None
    result = place(devices, [Assignment(POD, source, "d", named)])
    return next(iter(result.pods), None)


@pytest.mark.parametrize(
    ("resource", "device_id", "expected"),
    [
        (
            "nvidia.com/gpu",
            "GPU-6f2b1c7e-0a1b-4c2d-8e9f-0123456789ab",
            DeviceKey(uuid="gpu-6f2b1c7e-0a1b-4c2d-8e9f-0123456789ab"),
        ),
        ("nvidia.com/gpu", "GPU-ABC::3", DeviceKey(uuid="gpu-abc")),
        ("nvidia.com/gpu.shared", "GPU-abc::12", DeviceKey(uuid="gpu-abc")),
        (
            "nvidia.com/mig-1g.5gb",
            "MIG-11111111-2222-3333-4444-555555555555",
            DeviceKey(uuid="mig-11111111-2222-3333-4444-555555555555"),
        ),
        ("nvidia.com/mig-1g.5gb", "MIG-GPU-abc/1/0", DeviceKey(uuid="mig-gpu-abc/1/0")),
        ("nvidia.com/gpu", "nvidia3", DeviceKey(minor=3)),
        ("nvidia.com/gpu", "/dev/nvidia0", DeviceKey(minor=0)),
        ("nvidia.com/gpu", "2", DeviceKey(index=2)),
        ("nvidia.com/gpu", "1::0", DeviceKey(index=1)),
        ("nvidia.com/gpu", "0:1", DeviceKey(mig_slot=(0, 1))),
        ("nvidia.com/gpu", "nvidia2/vgpu3", DeviceKey(minor=2)),  # GKE: a time-shared replica
        ("nvidia.com/gpu", "nvidia3/gi1", DeviceKey(minor=3, gpu_instance=1)),  # GKE: a MIG instance
        ("nvidia.com/gpu", "nvidia10/gi12/vgpu0", DeviceKey(minor=10, gpu_instance=12)),
        ("amd.com/gpu", "GPU-abc", None),
        ("example.com/fpga", "0", None),
    ],
)
def test_device_plugin_ids(resource: str, device_id: str, expected: Named | None) -> None:
    """UUIDs, shared replicas, indices, nvidia<minor> and GKE's forms name a device; others are not ours."""
    assert device_plugin_name(resource, device_id) == expected


@pytest.mark.parametrize(
    "device_id",
    [
        "nvidiactl",
        "",
        "01",
        "nvidia-1",
        " GPU-abc",
        "3::",
        "GPU-abc::x",
        "0:1:2",
        "-1",
        "nvidia0/gi",
        "nvidia0/vgpu",
        "nvidia0/gi01",
        "nvidia0/vgpu1/gi0",
        "nvidia0/gi1/vgpu1/vgpu2",
        "/dev/nvidia0/gi1",
        "nvidia0/gi1::2",
        "nvidia0/mig1",
    ],
)
def test_malformed_device_plugin_ids_are_unplaced(device_id: str) -> None:
    """An nvidia.com id of no known form is unplaced (its pod's share unknown), naming the forms read."""
    named = device_plugin_name("nvidia.com/gpu", device_id)
    assert isinstance(named, Unplaceable)
    assert named.kind is ReadErrorKind.OTHER
    assert "GPU-<uuid>" in named.detail
    assert "nvidia<minor>/gi<id>" in named.detail


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("gpu-0", DeviceKey(minor=0)),
        ("gpu-12", DeviceKey(minor=12)),
        ("gpu-0-mig-1g5gb-19-0", DeviceKey(minor=0, mig=(19, 0))),
        ("gpu-3-mig-1g10gb-me-19-6", DeviceKey(minor=3, mig=(19, 6))),
        ("gpu-1-mig-1c2g10gb-14-2", DeviceKey(minor=1, mig=(14, 2))),
        ("gpu-7-mig-7g80gb-0-0", DeviceKey(minor=7, mig=(0, 0))),
        (
            "gpu-0-mig-19-0-1",
            DeviceKey(minor=0, mig=(19, 0)),
        ),  # v25.3.0-v25.8.1: gpu-<minor>-mig-<profileId>-<start>-<size>
        ("gpu-2-mig-9-4-4", DeviceKey(minor=2, mig=(9, 4))),
        ("GPU-abc", DeviceKey(uuid="gpu-abc")),
        ("gpu-vfio-2", Unplaceable(VFIO_DETAIL, ReadErrorKind.NOT_SUPPORTED)),
    ],
)
def test_dra_device_names(device: str, expected: Named) -> None:
    """The driver's GPU, MIG and vfio names (v0.4.1, and the all-number MIG form of v25.3.0 to v25.8.1) parse to
    what places them."""
    assert dra_name("gpu.nvidia.com", device) == expected


@pytest.mark.parametrize(
    "device",
    [
        "gpu-01",
        "gpu-",
        "gpu-0-mig-19-0",
        "gpu-0-mig-19-00-1",
        "gpu-0-mig-19-0-1-2",
        "gpu-0-mig-1g.5gb-19-0",
        "gpu-0-mig-1g5gb-19",
        "gpu-0-mig-1g5gb-19-0-extra",
        "gpu-vfio-",
        "Gpu-0",
        "gpu-0 ",
        "channel-0",
    ],
)
def test_malformed_dra_names_are_unplaced(device: str) -> None:
    """A name of a listed driver in no known form is unplaced, naming the forms and the release they come from."""
    named = dra_name("gpu.nvidia.com", device)
    assert isinstance(named, Unplaceable)
    assert named.kind is ReadErrorKind.OTHER
    assert "v0.4.1" in named.detail


def test_drivers_not_listed_are_not_read() -> None:
    """Only the drivers in --dra-drivers are read: another's devices (a compute domain's channel) are not GPUs."""
    assert dra_name("compute-domain.nvidia.com", "gpu-0") is None
    assert dra_name("gpu.example.com", "gpu-0") is None
    assert dra_name("gpu.example.com", "gpu-0", ("gpu.nvidia.com", "gpu.example.com")) == DeviceKey(minor=0)


def test_names_place_by_minor_number_not_index() -> None:
    """gpu-<minor> and nvidia<minor> land on the GPU with that minor number; a bare index on the NVML index."""
    devices = enumerated(node_nvml())
    assert placed_as(devices, dra_name("gpu.nvidia.com", "gpu-0")) == "GPU-bbb"
    assert placed_as(devices, dra_name("gpu.nvidia.com", "gpu-1")) == "GPU-aaa"
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "nvidia1")) == "GPU-aaa"
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "0")) == "GPU-aaa"
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "GPU-BBB::2")) == "GPU-bbb"


def test_mig_names_place_by_parent_minor_profile_and_placement() -> None:
    """A DRA MIG name lands on the instance with that parent minor, GPU instance profile and placement start."""
    devices = enumerated(node_nvml())
    assert placed_as(devices, dra_name("gpu.nvidia.com", "gpu-3-mig-1g10gb-19-0")) == "MIG-x"
    assert placed_as(devices, dra_name("gpu.nvidia.com", "gpu-3-mig-2g20gb-14-2")) == "MIG-y"
    assert placed_as(devices, dra_name("gpu.nvidia.com", "gpu-3-mig-19-0-1")) == "MIG-x"  # v25.3.0 to v25.8.1
    assert placed_as(devices, device_plugin_name("nvidia.com/mig-1g.10gb", "MIG-x")) == "MIG-x"


def test_mig_index_names_place_by_parent_index_and_nvml_mig_slot() -> None:
    """``N:M`` lands on the instance in NVML MIG slot M of the GPU with NVML index N; an empty slot is skipped."""
    devices = enumerated(node_nvml())
    assert placed_as(devices, device_plugin_name("nvidia.com/mig-1g.10gb", "2:0")) == "MIG-x"
    assert placed_as(devices, device_plugin_name("nvidia.com/mig-2g.20gb", "2:2::1")) == "MIG-y"
    assert placed_as(devices, device_plugin_name("nvidia.com/mig-1g.10gb", "2:1")) is None


def test_gke_names_place_by_minor_number_and_gpu_instance_id() -> None:
    """GKE's nvidia<minor>/vgpu<n> lands on that GPU, nvidia<minor>/gi<id>[/vgpu<n>] on the instance with that GI id."""
    devices = enumerated(node_nvml())
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "nvidia1/vgpu0")) == "GPU-aaa"
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "nvidia0/vgpu7")) == "GPU-bbb"
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "nvidia3/gi1")) == "MIG-x"
    assert placed_as(devices, device_plugin_name("nvidia.com/gpu", "nvidia3/gi2/vgpu4")) == "MIG-y"


def test_gke_shared_replicas_count_as_the_gpu_or_instance_they_share() -> None:
    """Pods on two /vgpu replicas of one GPU or MIG instance each hold it, as ``::`` replicas do."""
    devices = enumerated(node_nvml())
    names = ["nvidia3/gi1/vgpu0", "nvidia3/gi1/vgpu1", "nvidia1/vgpu0", "nvidia1/vgpu1"]
    keys = [device_plugin_name("nvidia.com/gpu", name) for name in names]
    assert all(isinstance(key, DeviceKey) for key in keys)
    result = place(
        devices,
        [
            Assignment(pod, "nvidia.com/gpu", name, key)
            for pod, name, key in zip([POD, OTHER, OTHER, POD], names, keys, strict=True)
            if isinstance(key, DeviceKey)
        ],
    )
    assert result.pods == {"MIG-x": (POD, OTHER), "GPU-aaa": (POD, OTHER)}
    assert result.unplaced == ()


def test_gke_instance_names_are_unplaced_where_nvml_gives_no_gpu_instance_ids() -> None:
    """Without NVML's GPU instance ids an nvidia<minor>/gi<id> name is unplaced, saying so, never guessed."""
    devices = [
        GpuIdentity(0, "GPU-p", "g", minor=0),
        GpuIdentity(0, "MIG-a", "g", mig_parent_uuid="GPU-p", minor=0),
    ]
    named = device_plugin_name("nvidia.com/gpu", "nvidia0/gi1")
    assert named is not None
    result = place(devices, [Assignment(POD, "nvidia.com/gpu", "nvidia0/gi1", named)])
    [unplaced] = result.unplaced
    assert "NVML did not give the GPU instance ids" in unplaced.detail
    assert not result.awaiting


def test_dynamic_mig_instance_is_unplaced_until_enumerated_then_placed() -> None:
    """An instance a DRA driver makes on demand is unknown until the agent enumerates it, then placed."""
    nvml = node_nvml()
    before = enumerated(nvml)
    name = dra_name("gpu.nvidia.com", "gpu-3-mig-3g40gb-9-4")
    assert name is not None
    pending = place(before, [Assignment(POD, "gpu.nvidia.com", "gpu-3-mig-3g40gb-9-4", name)])
    assert pending.pods == {}
    [unplaced] = pending.unplaced
    assert unplaced.kind is ReadErrorKind.OTHER
    assert "profile 9 at placement 4" in unplaced.detail
    assert "profile 19 at 0, profile 14 at 2" in unplaced.detail

    nvml.create_mig(2, FakeDevice("MIG-dyn", gpu_instance_id=5, gi_profile_id=9, placement_start=4))
    assert placed_as(enumerated(nvml), name) == "MIG-dyn"


@pytest.mark.parametrize(
    ("source", "device", "detail"),
    [
        ("gpu.nvidia.com", "gpu-5", "no whole GPU on this node has minor number 5 (theirs: 0, 1)"),
        ("gpu.nvidia.com", "gpu-3", "the GPU with minor number 3 is in MIG mode"),
        ("gpu.nvidia.com", "gpu-9-mig-1g10gb-19-0", "on the GPU with minor number 9 (its instances: none)"),
        ("nvidia.com/gpu", "7", "no whole GPU on this node has NVML index 7 (theirs: 0, 1)"),
        ("nvidia.com/gpu", "2", "the GPU with NVML index 2 is in MIG mode"),
        ("nvidia.com/gpu", "GPU-elsewhere", "no GPU or MIG instance on this node has that UUID"),
        ("nvidia.com/gpu", "2:1", "no MIG instance in slot 1 of the GPU with NVML index 2"),
        ("nvidia.com/gpu", "nvidia5/vgpu0", "no whole GPU on this node has minor number 5 (theirs: 0, 1)"),
        ("nvidia.com/gpu", "nvidia3/vgpu0", "the GPU with minor number 3 is in MIG mode"),
        (
            "nvidia.com/gpu",
            "nvidia3/gi7/vgpu1",
            "no MIG instance with GPU instance id 7 on the GPU with minor number 3 (its GPU instance ids: 1, 2)",
        ),
        ("nvidia.com/gpu", "nvidia1/gi1", "no MIG instance with GPU instance id 1 on the GPU with minor number 1"),
    ],
)
def test_names_no_device_carries_are_unplaced_with_the_reason(source: str, device: str, detail: str) -> None:
    """A well-formed name that no enumerated device carries is an unknown share for its pod, saying why."""
    devices = enumerated(node_nvml())
    named = dra_name(source, device) if "/" not in source else device_plugin_name(source, device)
    assert named is not None
    result = place(devices, [Assignment(POD, source, device, named)])
    assert result.pods == {}
    [unplaced] = result.unplaced
    assert (unplaced.pod, unplaced.device, unplaced.kind) == (POD, f"{source} device {device!r}", ReadErrorKind.OTHER)
    assert detail in unplaced.detail


def test_vfio_device_is_unplaced_as_not_supported() -> None:
    """A GPU passed through to a VM is unplaced as NOT_SUPPORTED: left out, not unknown for ever."""
    named = dra_name("gpu.nvidia.com", "gpu-vfio-0")
    assert named is not None
    result = place(enumerated(node_nvml()), [Assignment(POD, "gpu.nvidia.com", "gpu-vfio-0", named)])
    assert result.unplaced == (
        UnplacedDevice(POD, "gpu.nvidia.com device 'gpu-vfio-0'", ReadErrorKind.NOT_SUPPORTED, VFIO_DETAIL),
    )


def test_minor_names_are_unplaced_where_nvml_gives_no_minor_numbers() -> None:
    """Without NVML's minor numbers a gpu-<minor> name is unplaced, never read as an index."""
    devices = [GpuIdentity(0, "GPU-a", "g"), GpuIdentity(1, "GPU-b", "g")]
    named = dra_name("gpu.nvidia.com", "gpu-0")
    assert named is not None
    [unplaced] = place(devices, [Assignment(POD, "gpu.nvidia.com", "gpu-0", named)]).unplaced
    assert "minor numbers" in unplaced.detail


def test_shared_devices_count_for_each_pod_once() -> None:
    """Pods sharing a GPU (one claim, or time-sliced replicas) each hold it; repeats collapse; sorted."""
    devices = enumerated(node_nvml())
    gpu1 = dra_name("gpu.nvidia.com", "gpu-1")
    replica = device_plugin_name("nvidia.com/gpu", "GPU-aaa::1")
    unknown = dra_name("gpu.nvidia.com", "gpu-5")
    assert gpu1 is not None
    assert replica is not None
    assert unknown is not None
    result = place(
        devices,
        [
            Assignment(OTHER, "gpu.nvidia.com", "gpu-1", gpu1),
            Assignment(POD, "gpu.nvidia.com", "gpu-1", gpu1),
            Assignment(POD, "nvidia.com/gpu", "GPU-aaa::1", replica),
            Assignment(POD, "gpu.nvidia.com", "gpu-5", unknown),
            Assignment(POD, "gpu.nvidia.com", "gpu-5", unknown),
        ],
    )
    assert result.pods == {"GPU-aaa": (POD, OTHER)}
    assert [u.device for u in result.unplaced] == ["gpu.nvidia.com device 'gpu-5'"]


@pytest.mark.parametrize(
    ("source", "device", "awaiting"),
    [
        ("gpu.nvidia.com", "gpu-3-mig-3g40gb-9-4", True),
        ("gpu.nvidia.com", "gpu-5", True),
        ("nvidia.com/gpu", "GPU-elsewhere", True),
        ("gpu.nvidia.com", "gpu-vfio-0", False),
        ("gpu.nvidia.com", "gpu-3", False),
        ("gpu.nvidia.com", "not-a-gpu", False),
        ("nvidia.com/gpu", "2:1", True),
        ("nvidia.com/gpu", "nvidia3/gi7", True),
        ("nvidia.com/gpu", "nvidia3/vgpu0", False),
    ],
)
def test_only_names_a_new_device_could_carry_ask_for_enumeration(source: str, device: str, awaiting: bool) -> None:
    """A well-formed name no device carries may be a device made since; a VM's, a malformed or ambiguous one is not."""
    named = dra_name(source, device) if "/" not in source else device_plugin_name(source, device)
    assert named is not None
    assert place(enumerated(node_nvml()), [Assignment(POD, source, device, named)]).awaiting is awaiting
