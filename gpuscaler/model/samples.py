"""What one poll tick read from the GPUs: immutable samples with units in their names.

A value that could not be read is None and its reason is in ``errors``; it is never 0. The per-GPU records
are named tuples rather than frozen dataclasses: a gateway builds tens of thousands a second, and a named
tuple is immutable too but several times cheaper to make.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.model.windows import WindowKey, WindowValues

T = TypeVar("T")

# `ReadError.field` for a failure of the whole device rather than of one field.
DEVICE_FIELD = "device"
# `ReadError.field` for per-process reads (the process list, and the pods they run in).
PROCESSES_FIELD = "processes"


class ReadErrorKind(enum.Enum):
    """Why a value is absent; decides the gRPC status a query over it gets."""

    NOT_SUPPORTED = "not_supported"
    GPU_LOST = "gpu_lost"
    TIMEOUT = "timeout"
    OTHER = "other"


class ReadError(NamedTuple):
    """One field (or the whole device) that could not be read, with the reader's own words."""

    field: str
    kind: ReadErrorKind
    detail: str
    # When the agent last read this field (for DEVICE_FIELD: the GPU), seconds since the epoch; None when it has
    # not since it started, or the field is NOT_SUPPORTED. The poll loop stamps it (``last_reads.py``).
    last_read_at: float | None = None


class PodRef(NamedTuple):
    """A container the kubelet assigned a GPU to."""

    namespace: str
    pod: str
    container: str


class AttributionState(enum.Enum):
    """Whether a node's samples say which pods hold each GPU (the kubelet's PodResources API)."""

    OFF = "off"  # --pod-resources-socket is empty, or there is no socket at that path: FAILED_PRECONDITION
    UNAVAILABLE = "unavailable"  # the socket is there but List fails: UNAVAILABLE, KEDA retries
    OK = "ok"


class UnplacedDevice(NamedTuple):
    """A device the kubelet assigned to a container that no GPU the collector enumerates carries.

    ``device`` is the name as the kubelet gave it (``gpu.nvidia.com/gpu-3``, ``nvidia.com/gpu 0:1``) and ``detail``
    why it could not be placed. ``kind`` is NOT_SUPPORTED for a device NVML can never see on the node (a GPU passed
    through to a VM), which an answer leaves out as it leaves out a GPU that lacks the metric, and OTHER for a name
    it could not place now, which makes the pod's share unknown.
    """

    pod: PodRef
    device: str
    kind: ReadErrorKind
    detail: str


@dataclass(frozen=True, slots=True)
class Attribution:
    """A node's attribution state at one tick; ``detail`` says why when it is not OK.

    ``unplaced`` lists the devices held by the node's pods that the tick could not tie to a GPU.
    """

    state: AttributionState
    detail: str = ""
    unplaced: tuple[UnplacedDevice, ...] = ()


ATTRIBUTION_OFF = Attribution(
    AttributionState.OFF, "pod attribution is off (the agent's --pod-resources-socket is empty)"
)


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """A device as the collector enumerates it: a whole GPU, or one MIG instance of it."""

    index: int
    uuid: str
    name: str
    mig_parent_uuid: str | None = None
    # Facts the agent reads once per device when it enumerates it, to place the kubelet's device names
    # (``agent/attribution/devices.py``); None where NVML did not say. ``minor`` is the ``/dev/nvidiaN`` number of
    # the physical GPU (a MIG instance's: its parent's), which device names use and which need not be the index; a
    # MIG instance's GPU instance profile id and placement start are the rest of a DRA MIG device's name, its GPU
    # instance id the rest of GKE's device plugin's (``nvidia<minor>/gi<id>``). They stay
    # on the node (the wire does not carry them), so they take no part in equality: a gateway's decoded identity
    # is the same device.
    minor: int | None = field(default=None, compare=False)
    gpu_instance_id: int | None = field(default=None, compare=False)
    gpu_instance_profile_id: int | None = field(default=None, compare=False)
    placement_start: int | None = field(default=None, compare=False)
    # Why NVML would not give the MIG placement (a refusal such as no permission), for names that need it.
    placement_problem: str | None = field(default=None, compare=False)
    # A MIG instance's slot on its parent (nvmlDeviceGetMigDeviceHandleByIndex), the M of an ``N:M`` device name.
    mig_slot: int | None = field(default=None, compare=False)
    # A device a pod holds that no enumerated GPU carries (``UnplacedDevice``), stood in for inside a pod query's
    # evaluation so that its share is unknown there; ``uuid`` is then the device as the kubelet named it.
    unplaced: bool = False

    def describe(self) -> str:
        """The device as answers name it: ``GPU 3 (GPU-…)``, or an unplaced device by its kubelet name."""
        return f"unplaced {self.uuid}" if self.unplaced else f"GPU {self.index} ({self.uuid})"


class ProcessUsage(NamedTuple):
    """One process on a GPU at one tick, and the pod it runs in, from NVML and ``/proc/<pid>/cgroup``.

    ``pod_uid`` is the Kubernetes pod UID its cgroup names, ``""`` for a process outside any pod (a host
    daemon), and None when its cgroup could not be read (it exited, or the agent cannot see host PIDs).
    A utilisation of None is unknown (NVML gave no per-process figures); 0.0 is a process NVML lists that
    ran no kernel in the last sample period.
    """

    pid: int
    pod_uid: str | None = None
    container_id: str | None = None
    sm_percent: float | None = None
    memory_utilization_percent: float | None = None
    memory_used_bytes: int | None = None


class GpuSample(NamedTuple):
    """One device's readings at one tick. Percentages are 0-100, memory in bytes, power in watts, energy in joules,
    PCIe and NVLink traffic in MB/s (10**6 bytes a second).

    ``processes`` is None when the agent does not read processes (``--processes`` is off, or the read failed:
    see ``errors``), and a tuple, maybe empty, when it read them.
    """

    gpu: GpuIdentity
    node: str
    gpu_utilization_percent: float | None = None
    memory_utilization_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_draw_watts: float | None = None
    power_limit_watts: float | None = None
    sm_active_percent: float | None = None
    sm_occupancy_percent: float | None = None
    tensor_active_percent: float | None = None
    dram_bandwidth_percent: float | None = None
    energy_joules: float | None = None
    pcie_tx_megabytes_per_second: float | None = None
    pcie_rx_megabytes_per_second: float | None = None
    nvlink_tx_megabytes_per_second: float | None = None
    nvlink_rx_megabytes_per_second: float | None = None
    errors: tuple[ReadError, ...] = ()
    pods: tuple[PodRef, ...] = ()
    processes: tuple[ProcessUsage, ...] | None = None

    def value(self, metric: Metric) -> float | None:
        """The metric in its documented unit, or None when a field it needs was not read.

        A rate (``power_average``) has no value in one sample: it needs two (see ``agent/rates.py``).
        """
        info = METRICS[metric]
        if not info.in_one_sample:
            return None
        reading = getattr(self, info.reading)
        if info.of is None:
            return None if reading is None else float(reading)
        return percent_of(reading, getattr(self, info.of))

    def error_for(self, metric: Metric) -> ReadError | None:
        """The reason ``value(metric)`` is None: a device-wide error first, then the field's own."""
        sources = METRICS[metric].fields
        for error in self.errors:
            if error.field == DEVICE_FIELD:
                return error
        for error in self.errors:
            if error.field in sources or error.field == metric.value:
                return error
        return None


def percent_of(part: float | None, whole: float | None) -> float | None:
    """``part`` as a percentage of ``whole``; None where either is unknown or the whole is not positive."""
    if part is None or whole is None or whole <= 0:
        return None
    return 100.0 * part / whole


GpuKey = tuple[str, str]  # a GPU across a cluster: (node, UUID)


def gpu_keys(samples: Iterable[GpuSample]) -> Iterator[GpuKey]:
    """Each sample's GPU as (node, UUID)."""
    return ((sample.node, sample.gpu.uuid) for sample in samples)


@dataclass(frozen=True, slots=True)
class Absence:
    """A node whose GPUs a cluster answer cannot see now, or an agent whose node is not known.

    ``node`` is None for a listed agent that has sent no snapshot since the gateway started, or whose
    snapshots are refused (it claims a node another agent reports). ``last`` is the node's newest
    snapshot, which says which pods it held; ``since`` is wall-clock seconds since the epoch.

    ``heard`` marks a node that is heard but none of whose selected GPUs can be read now (every one lost or
    hung): as unknown as a silent node, for one answer. The gateway keeps no history, so ``since`` is when
    the snapshot that says so was taken, and ``agent`` is empty (the node's snapshot does not name it).
    """

    agent: str
    node: str | None
    since: float
    reason: str
    last: Snapshot | None = None
    heard: bool = False

    def describe(self, now: float) -> str:
        """One clause for an error message: who, since when, and why."""
        if self.heard:
            return f"node {self.node!r} is heard, but {self.reason}"
        when = datetime.datetime.fromtimestamp(self.since, datetime.UTC).isoformat(timespec="seconds")
        ago = f"{max(0.0, now - self.since):.1f}s ago"
        who = f"node {self.node!r} (agent {self.agent})" if self.node else f"agent {self.agent}"
        return f"{who} since {when} ({ago}): {self.reason}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every device's sample from one poll tick.

    ``taken_at`` is wall-clock seconds since the epoch (for people and the wire);
    ``monotonic`` is the loop's clock (for ages and windows, immune to clock steps).

    A gateway composes one snapshot of the whole cluster (``cluster``): ``samples`` is then every fresh
    node's samples, ``parts`` the node snapshots they came from, and ``absent`` every listed agent whose
    node is silent or unknown, so that an answer can tell a share it cannot see from a share that is 0.

    A node's snapshot that crossed the wire also carries ``windows``: for each window a gateway asked its
    agent for, each GPU's windowed value by UUID (the agent keeps the history; the gateway keeps none).
    """

    sequence: int
    taken_at: float
    monotonic: float
    node: str
    samples: Sequence[GpuSample] = ()
    attribution: Attribution = ATTRIBUTION_OFF
    parts: tuple[Snapshot, ...] = ()
    absent: tuple[Absence, ...] = ()
    cluster: bool = False
    windows: Mapping[WindowKey, WindowValues] = field(default_factory=dict)

    @property
    def nodes(self) -> tuple[Snapshot, ...]:
        """The fresh node snapshots this one is made of: ``parts`` for a cluster, itself for a node."""
        return self.parts if self.cluster else (self,)

    @property
    def known_nodes(self) -> int:
        """Nodes the answer should cover: the fresh ones and the absent ones."""
        return len(self.nodes) + len(self.absent)
