"""Kubelet device ids to the GPUs the collector enumerates. Pure functions.

The NVIDIA device plugin names a device by its UUID (``GPU-<uuid>``, ``MIG-<uuid>``), by its index
(``0``, with ``DEVICE_ID_STRATEGY=index``), and adds ``::N`` to the replicas of a shared (time-sliced)
GPU. Other plugins and CDI use ``nvidiaN`` (the ``/dev/nvidiaN`` minor number, which we read as the
NVML index: both follow PCI bus order unless the GPUs were renumbered). NVIDIA's DRA driver
(``gpu.nvidia.com``) names whole GPUs ``gpu-N``. What names none of these is not ours, and is ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuscaler.model.pods import NVIDIA_RESOURCE_PREFIX
from gpuscaler.model.samples import GpuIdentity, PodRef

NVIDIA_DRA_DRIVER = "gpu.nvidia.com"
SHARED_SUFFIX = "::"

_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/_.-]*$")
_DEV_NODE = re.compile(r"^(?:/dev/)?nvidia(\d{1,4})$")
_INDEX = re.compile(r"^\d{1,4}$")
_DRA_GPU = re.compile(r"^gpu-(\d{1,4})$")


@dataclass(frozen=True, slots=True)
class DeviceKey:
    """A GPU as a device id names it: by UUID, or by NVML index (whole GPUs only)."""

    uuid: str | None = None
    index: int | None = None


def device_key(resource_name: str, device_id: str) -> DeviceKey | None:
    """The GPU a device-plugin device id names, or None when it is not an NVIDIA GPU we can place."""
    if not resource_name.startswith(NVIDIA_RESOURCE_PREFIX):
        return None
    return _key_from_id(device_id)


def dra_device_key(driver_name: str, device_name: str) -> DeviceKey | None:
    """The GPU a DRA claim's device names, or None (another driver, or a MIG slice we cannot place)."""
    if driver_name != NVIDIA_DRA_DRIVER:
        return None
    match = _DRA_GPU.match(device_name)
    if match:
        return DeviceKey(index=int(match.group(1)))
    return _key_from_id(device_name)


def _key_from_id(device_id: str) -> DeviceKey | None:
    text = device_id.strip()
    base, sep, replica = text.rpartition(SHARED_SUFFIX)
    if sep and replica.isdigit() and base:
        text = base
    if _UUID.match(text):
        return DeviceKey(uuid=text.lower())
    match = _DEV_NODE.match(text)
    if match:
        return DeviceKey(index=int(match.group(1)))
    if _INDEX.match(text):
        return DeviceKey(index=int(text))
    return None  # "0:1" (a MIG slice by index) and anything else: we cannot tell which instance


def pods_by_gpu(
    devices: Sequence[GpuIdentity], assignments: Iterable[tuple[DeviceKey, PodRef]]
) -> Mapping[str, tuple[PodRef, ...]]:
    """For each GPU UUID, the containers assigned to it, sorted and without repeats.

    An index names a whole GPU, never a MIG instance (whose identity carries its parent's index).
    """
    by_uuid = {gpu.uuid.lower(): gpu.uuid for gpu in devices}
    by_index = {gpu.index: gpu.uuid for gpu in devices if gpu.mig_parent_uuid is None}
    found: dict[str, set[PodRef]] = {}
    for key, pod in assignments:
        if key.uuid is not None:
            uuid = by_uuid.get(key.uuid)
        elif key.index is not None:
            uuid = by_index.get(key.index)
        else:
            uuid = None
        if uuid is not None:
            found.setdefault(uuid, set()).add(pod)
    return {uuid: tuple(sorted(pods, key=_pod_order)) for uuid, pods in found.items()}


def _pod_order(pod: PodRef) -> tuple[str, str, str]:
    return (pod.namespace, pod.pod, pod.container)
