"""Kubelet device ids map to the GPUs the collector enumerates."""

from __future__ import annotations

import pytest

from gpuscaler.agent.attribution.devices import DeviceKey, device_key, dra_device_key, pods_by_gpu
from gpuscaler.model.samples import GpuIdentity, PodRef


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
        ("nvidia.com/gpu", "nvidia3", DeviceKey(index=3)),
        ("nvidia.com/gpu", "/dev/nvidia0", DeviceKey(index=0)),
        ("nvidia.com/gpu", "2", DeviceKey(index=2)),
        ("nvidia.com/gpu", "1::0", DeviceKey(index=1)),
        ("nvidia.com/gpu", "0:1", None),
        ("nvidia.com/gpu", "nvidiactl", None),
        ("nvidia.com/gpu", "", None),
        ("amd.com/gpu", "GPU-abc", None),
        ("example.com/fpga", "0", None),
    ],
)
def test_device_plugin_ids(resource: str, device_id: str, expected: DeviceKey | None) -> None:
    """UUIDs, shared replicas, nvidiaN and index ids name a GPU; other resources and MIG-by-index do not."""
    assert device_key(resource, device_id) == expected


@pytest.mark.parametrize(
    ("driver", "device", "expected"),
    [
        ("gpu.nvidia.com", "gpu-0", DeviceKey(index=0)),
        ("gpu.nvidia.com", "gpu-12", DeviceKey(index=12)),
        ("gpu.nvidia.com", "GPU-abc", DeviceKey(uuid="gpu-abc")),
        ("gpu.nvidia.com", "gpu-0-mig-9-0-1", None),
        ("compute-domain.nvidia.com", "gpu-0", None),
        ("gpu.example.com", "gpu-0", None),
    ],
)
def test_dra_devices(driver: str, device: str, expected: DeviceKey | None) -> None:
    """NVIDIA's DRA driver names whole GPUs gpu-N; other drivers and MIG slices are not placed."""
    assert dra_device_key(driver, device) == expected


def test_pods_by_gpu_matches_uuid_case_insensitively_and_index_on_whole_gpus_only() -> None:
    """An index never names a MIG instance; UUIDs match in any case; repeats collapse, sorted."""
    devices = [
        GpuIdentity(index=0, uuid="GPU-AAA", name="g"),
        GpuIdentity(index=1, uuid="MIG-BBB", name="g", mig_parent_uuid="GPU-PARENT"),
    ]
    a, b = PodRef("ml", "a", "main"), PodRef("ml", "b", "main")
    found = pods_by_gpu(
        devices,
        [
            (DeviceKey(uuid="gpu-aaa"), b),
            (DeviceKey(index=0), a),
            (DeviceKey(index=0), a),
            (DeviceKey(index=1), a),
            (DeviceKey(uuid="mig-bbb"), b),
            (DeviceKey(uuid="gpu-elsewhere"), a),
        ],
    )
    assert found == {"GPU-AAA": (a, b), "MIG-BBB": (b,)}
