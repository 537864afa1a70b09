"""Kubelet device names to the GPUs the collector enumerates, by the identities NVML gives. Pure functions.

Device plugins (resources ``nvidia.com/*``) name a device by its UUID (``GPU-<uuid>``, ``MIG-<uuid>``), by its NVML
index (``0``; a MIG instance ``N:M``), or by its minor number (``nvidiaN``, ``/dev/nvidiaN``), and add ``::N`` to the
replicas of a shared (time-sliced) GPU. GKE's device plugin (GoogleCloudPlatform/container-engine-accelerators,
``pkg/gpu/nvidia``) names a GPU ``nvidia<minor>``, a MIG instance ``nvidia<minor>/gi<id>`` by its GPU instance id on
that GPU (``nvmlDeviceGetGpuInstanceId``), and adds ``/vgpu<n>`` to the replicas of a time-shared or MPS GPU or
instance, which count as the GPU or instance they share, as ``::<n>`` replicas do. NVIDIA's k8s-device-plugin gives the
kubelet UUIDs whatever its ``DEVICE_ID_STRATEGY`` (which changes only the container's ``NVIDIA_VISIBLE_DEVICES``); index
names come from other plugins that follow its index convention. NVIDIA's DRA driver (``gpu.nvidia.com``; names checked
against kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1) names a GPU ``gpu-<minor>``, a MIG device
``gpu-<parentMinor>-mig-<profile without dots>-<giProfileId>-<placementStart>`` (whether it made the instance at start
or on demand) and a GPU bound to vfio-pci for a VM ``gpu-vfio-<index>``, as NVIDIA/k8s-dra-driver-gpu v25.12.0 did.
Its releases v25.3.0 to v25.8.1 (checked by tag) name a MIG device
``gpu-<parentMinor>-mig-<giProfileId>-<placementStart>-<size>``, all numbers, which the current form's profile
(letters: ``1g10gb``) keeps apart; the size follows from the profile id. Release candidates before v25.3.0-rc.5
numbered both forms by NVML index, which no name says: they are not read correctly where minor and index differ.

Names are a driver's convention, not an API, so they are parsed strictly: a name of ours (a listed driver, an
``nvidia.com/`` resource) that none of these forms matches, or that no enumerated device carries, is an
``UnplacedDevice`` that makes its pod's share unknown, never absent. Two forms are decided apart:

- ``gpu-vfio-N``: the GPU is passed through to a VM, and NVML on the node never sees it. It is unplaced as
  NOT_SUPPORTED, so an answer leaves it out as it leaves out a GPU that lacks the metric: a pod that holds only
  such GPUs is Unsupported (measure inside the guest), never UNAVAILABLE for ever.
- ``N:M`` (a MIG device by index): N is the parent's NVML index and M the instance's NVML MIG slot
  (``nvmlDeviceGetMigDeviceHandleByIndex``), as k8s-device-plugin numbers them; placed by both.

Other drivers and other resources are not GPUs we read, and are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from gpuscaler.model.pods import NVIDIA_RESOURCE_PREFIX
from gpuscaler.model.samples import GpuIdentity, PodRef, ReadErrorKind, UnplacedDevice

NVIDIA_DRA_DRIVER = "gpu.nvidia.com"
DEFAULT_DRA_DRIVERS = (NVIDIA_DRA_DRIVER,)
SHARED_SUFFIX = "::"

_NUMBER = r"(0|[1-9][0-9]{0,3})"  # as Go's %d prints it: no sign, no leading zero
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/_.-]*$")
_DEV_NODE = re.compile(rf"^(?:/dev/)?nvidia{_NUMBER}$")
# GKE's device plugin: nvidia<minor>/vgpu<n> (gpusharing.go), nvidia<minor>/gi<id> (mig.go), and both.
_GKE = re.compile(rf"^nvidia{_NUMBER}(?:/gi{_NUMBER})?(?:/vgpu{_NUMBER})?$")
_INDEX = re.compile(rf"^{_NUMBER}$")
_MIG_BY_INDEX = re.compile(rf"^{_NUMBER}:{_NUMBER}$")
_DRA_GPU = re.compile(rf"^gpu-{_NUMBER}$")
# go-nvlib's profile string (1g.10gb, 1c.2g.10gb, 1g.10gb+me) lower-cased, dots dropped, other signs as '-'.
_DRA_MIG = re.compile(rf"^gpu-{_NUMBER}-mig-((?:[0-9]+c)?[0-9]+g[0-9]+gb(?:-[a-z][a-z0-9]*)*)-{_NUMBER}-{_NUMBER}$")
_DRA_MIG_NUMBERED = re.compile(rf"^gpu-{_NUMBER}-mig-{_NUMBER}-{_NUMBER}-{_NUMBER}$")  # v25.3.0-v25.8.1: ...-<size>
_DRA_VFIO = re.compile(rf"^gpu-vfio-{_NUMBER}$")

VFIO_DETAIL = (
    "a GPU passed through to a virtual machine (vfio-pci): NVML on the node cannot see it, so it is measured "
    "inside the guest, not here"
)


@dataclass(frozen=True, slots=True)
class DeviceKey:
    """A device as a name gives it: by UUID, NVML index or minor number (whole GPUs), or a MIG placement."""

    uuid: str | None = None
    index: int | None = None
    minor: int | None = None
    # (GPU instance profile id, placement start) of a MIG instance on the GPU whose minor number is ``minor``
    mig: tuple[int, int] | None = None
    # (parent's NVML index, NVML MIG slot) of a MIG instance named ``N:M``
    mig_slot: tuple[int, int] | None = None
    # The GPU instance id of a MIG instance on the GPU whose minor number is ``minor`` (GKE's ``nvidia<minor>/gi<id>``)
    gpu_instance: int | None = None


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """A name of ours that no NVML identity can place, and why."""

    detail: str
    kind: ReadErrorKind = ReadErrorKind.OTHER
    # A well-formed name no enumerated device carries: one made since (a DRA driver's dynamic MIG instance) is found
    # by enumerating the devices again.
    awaits_enumeration: bool = False


Named = DeviceKey | Unplaceable


@dataclass(frozen=True, slots=True)
class Assignment:
    """One device the kubelet assigned to a container, as named (``source`` is its resource or DRA driver)."""

    pod: PodRef
    source: str
    device: str
    named: Named

    @property
    def label(self) -> str:
        return f"{self.source} device {self.device!r}"


@dataclass(frozen=True, slots=True)
class Placed:
    """Each GPU's containers, by UUID, sorted and without repeats; and the devices no GPU carries."""

    pods: Mapping[str, tuple[PodRef, ...]]
    unplaced: tuple[UnplacedDevice, ...] = ()
    # Whether an unplaced name may be a device made since the last enumeration (``Unplaceable.awaits_enumeration``).
    awaiting: bool = False


def device_plugin_name(resource_name: str, device_id: str) -> Named | None:
    """What a device-plugin device id names; None when the resource is not an NVIDIA GPU's."""
    if not resource_name.startswith(NVIDIA_RESOURCE_PREFIX):
        return None
    text = device_id
    base, sep, replica = text.rpartition(SHARED_SUFFIX)
    if sep and base and _INDEX.match(replica):
        text = base
    if _UUID.match(text):
        return DeviceKey(uuid=text.lower())
    if match := _DEV_NODE.match(text):
        return DeviceKey(minor=int(match.group(1)))
    if match := _GKE.match(device_id):  # its own replica suffix, never with ``::``
        instance = match.group(2)
        return DeviceKey(minor=int(match.group(1)), gpu_instance=None if instance is None else int(instance))
    if match := _INDEX.match(text):
        return DeviceKey(index=int(match.group(1)))
    if match := _MIG_BY_INDEX.match(text):
        return DeviceKey(mig_slot=(int(match.group(1)), int(match.group(2))))
    return Unplaceable(
        "not a device id the NVIDIA device plugin gives (GPU-<uuid>, MIG-<uuid>, an NVML index, nvidia<minor>, "
        "each with ::<replica> when shared) nor one GKE's gives (nvidia<minor>, nvidia<minor>/gi<id>, each with "
        "/vgpu<replica> when shared)"
    )


def dra_name(driver_name: str, device_name: str, drivers: Sequence[str] = DEFAULT_DRA_DRIVERS) -> Named | None:
    """What a DRA claim's device names; None when its driver is not one the agent reads (``--dra-drivers``)."""
    if driver_name not in drivers:
        return None
    if match := _DRA_GPU.match(device_name):
        return DeviceKey(minor=int(match.group(1)))
    if match := _DRA_MIG.match(device_name):
        return DeviceKey(minor=int(match.group(1)), mig=(int(match.group(3)), int(match.group(4))))
    if match := _DRA_MIG_NUMBERED.match(device_name):
        return DeviceKey(minor=int(match.group(1)), mig=(int(match.group(2)), int(match.group(3))))
    if _DRA_VFIO.match(device_name):
        return Unplaceable(VFIO_DETAIL, ReadErrorKind.NOT_SUPPORTED)
    if _UUID.match(device_name):  # a driver that names devices by NVML UUID
        return DeviceKey(uuid=device_name.lower())
    return Unplaceable(
        "not a device name of the forms read (gpu-<minor>, gpu-<minor>-mig-<profile>-<profileId>-<placement>, "
        "gpu-vfio-<index> as dra-driver-nvidia-gpu v0.4.1 gives them, gpu-<minor>-mig-<profileId>-<placement>-<size> "
        "as v25.3.0 to v25.8.1 did, or an NVML UUID)"
    )


def place(devices: Sequence[GpuIdentity], assignments: Iterable[Assignment]) -> Placed:
    """Each assignment's device among ``devices``; what none carries is unplaced, once per container and device."""
    table = _Table(devices)
    found: dict[str, set[PodRef]] = {}
    unplaced: dict[tuple[PodRef, str], UnplacedDevice] = {}
    awaiting = False
    for assignment in assignments:
        named = assignment.named
        where = table.find(named) if isinstance(named, DeviceKey) else named
        if isinstance(where, str):
            found.setdefault(where, set()).add(assignment.pod)
            continue
        awaiting = awaiting or where.awaits_enumeration
        key = (assignment.pod, assignment.label)
        unplaced.setdefault(key, UnplacedDevice(assignment.pod, assignment.label, where.kind, where.detail))
    return Placed(
        pods={uuid: tuple(sorted(pods, key=_pod_order)) for uuid, pods in found.items()},
        unplaced=tuple(sorted(unplaced.values(), key=lambda u: (*_pod_order(u.pod), u.device))),
        awaiting=awaiting,
    )


class _Table:
    """The node's devices by each identity a name can give."""

    def __init__(self, devices: Sequence[GpuIdentity]) -> None:
        self.by_uuid = {gpu.uuid.lower(): gpu.uuid for gpu in devices}
        parents = {gpu.mig_parent_uuid for gpu in devices if gpu.mig_parent_uuid is not None}
        # A MIG-enabled GPU is listed as its instances, each with the GPU's index and minor number.
        self.partitioned_indices = {gpu.index for gpu in devices if gpu.mig_parent_uuid is not None}
        self.partitioned_minors = {gpu.minor for gpu in devices if gpu.mig_parent_uuid is not None}
        whole = [gpu for gpu in devices if gpu.mig_parent_uuid is None and gpu.uuid not in parents]
        self.by_index = {gpu.index: gpu.uuid for gpu in whole}
        self.by_minor = {gpu.minor: gpu.uuid for gpu in whole if gpu.minor is not None}
        self.by_mig: dict[tuple[int, int, int], str] = {
            (gpu.minor, gpu.gpu_instance_profile_id, gpu.placement_start): gpu.uuid
            for gpu in devices
            if gpu.mig_parent_uuid is not None
            and gpu.minor is not None
            and gpu.gpu_instance_profile_id is not None
            and gpu.placement_start is not None
        }
        self.by_gpu_instance = {
            (gpu.minor, gpu.gpu_instance_id): gpu.uuid
            for gpu in devices
            if gpu.mig_parent_uuid is not None and gpu.minor is not None and gpu.gpu_instance_id is not None
        }
        # Minor numbers of the GPUs with a MIG instance whose GPU instance id NVML did not give.
        self.gpu_instances_unknown = {
            gpu.minor for gpu in devices if gpu.mig_parent_uuid is not None and gpu.gpu_instance_id is None
        }
        self.by_mig_slot = {
            (gpu.index, gpu.mig_slot): gpu.uuid
            for gpu in devices
            if gpu.mig_parent_uuid is not None and gpu.mig_slot is not None
        }
        self.minors_known = all(gpu.minor is not None for gpu in devices)
        # Why NVML would not give the placements on a GPU (by minor number): a name there is unplaced for that.
        self.refused = {
            gpu.minor: gpu.placement_problem
            for gpu in devices
            if gpu.mig_parent_uuid is not None and gpu.placement_problem is not None
        }

    def find(self, key: DeviceKey) -> str | Unplaceable:
        """The UUID the key names, or why no device carries it."""
        if key.uuid is not None:
            uuid = self.by_uuid.get(key.uuid)
            if uuid is not None:
                return uuid
            return Unplaceable("no GPU or MIG instance on this node has that UUID", awaits_enumeration=True)
        if key.index is not None:
            return self._whole(self.by_index, self.partitioned_indices, key.index, "NVML index")
        if key.mig_slot is not None:
            uuid = self.by_mig_slot.get(key.mig_slot)
            if uuid is not None:
                return uuid
            index, slot = key.mig_slot
            return Unplaceable(
                f"no MIG instance in slot {slot} of the GPU with NVML index {index}", awaits_enumeration=True
            )
        if key.minor is None:
            return Unplaceable("the name gives no device")
        if not self.minors_known:
            return Unplaceable("NVML did not give this node's GPUs' minor numbers, which the name is in")
        if key.gpu_instance is not None:
            return self._gpu_instance(key.minor, key.gpu_instance)
        if key.mig is None:
            return self._whole(self.by_minor, self.partitioned_minors, key.minor, "minor number")
        profile, start = key.mig
        uuid = self.by_mig.get((key.minor, profile, start))
        if uuid is not None:
            return uuid
        refused = self.refused.get(key.minor)
        if refused is not None:
            return Unplaceable(f"{refused}, so no MIG instance on the GPU with minor number {key.minor} can be placed")
        return Unplaceable(
            f"no MIG instance of GPU instance profile {profile} at placement {start} on the GPU with minor number "
            f"{key.minor} (its instances: {self._instances(key.minor)}); one made since the agent last enumerated "
            "the GPUs is placed at the next enumeration",
            awaits_enumeration=True,
        )

    def _gpu_instance(self, minor: int, gpu_instance: int) -> str | Unplaceable:
        uuid = self.by_gpu_instance.get((minor, gpu_instance))
        if uuid is not None:
            return uuid
        if minor in self.gpu_instances_unknown:
            refused = self.refused.get(minor) or "NVML did not give the GPU instance ids"
            return Unplaceable(f"{refused}, so no MIG instance on the GPU with minor number {minor} can be placed")
        here = ", ".join(str(gi) for m, gi in sorted(self.by_gpu_instance) if m == minor) or "none"
        return Unplaceable(
            f"no MIG instance with GPU instance id {gpu_instance} on the GPU with minor number {minor} (its GPU "
            f"instance ids: {here}); one made since the agent last enumerated the GPUs is placed at the next "
            "enumeration",
            awaits_enumeration=True,
        )

    @staticmethod
    def _whole(
        table: Mapping[int, str], partitioned: AbstractSet[int | None], number: int, what: str
    ) -> str | Unplaceable:
        uuid = table.get(number)
        if uuid is not None:
            return uuid
        if number in partitioned:
            return Unplaceable(
                f"the GPU with {what} {number} is in MIG mode: a whole-GPU name does not say which instance"
            )
        present = ", ".join(map(str, sorted(table))) or "none"
        return Unplaceable(
            f"no whole GPU on this node has {what} {number} (theirs: {present})", awaits_enumeration=True
        )

    def _instances(self, minor: int) -> str:
        here = sorted((start, profile) for (m, profile, start) in self.by_mig if m == minor)
        return ", ".join(f"profile {profile} at {start}" for start, profile in here) or "none"


def _pod_order(pod: PodRef) -> tuple[str, str, str]:
    return (pod.namespace, pod.pod, pod.container)
