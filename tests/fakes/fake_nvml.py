"""A fake ``pynvml`` module: the calls NvmlCollector makes, over GPUs described in plain data.

Each device can be told to raise an NVML error per call (by NVML return code), to hang, or to be
MIG-enabled with instances. Codes are NVML's own (3 NotSupported, 13 FunctionNotFound, 15 GpuIsLost...).

GPM is modelled as NVML has it: samples are allocated and freed by the caller (the fake counts both and
refuses a sample freed twice or used after its free), a metric is computed from two samples of one device,
and a device that is not Hopper or newer says so through ``nvmlGpmQueryDeviceSupport``. Per-process
utilisation returns the samples newer than the caller's timestamp, and NOT_FOUND when there are none.

PCIe throughput is a device's KB/s; NVLink's throughput counters are KiB totals a test advances, answered
per link (the total split evenly) or for all links at once (scope UINT_MAX), and a device without NVLink
answers NOT_SUPPORTED to ``nvmlDeviceGetNvLinkState`` and to the counters, as NVML does.

A GPU's minor number (``/dev/nvidiaN``) is its own (``minor``), which a test sets apart from its index; a MIG
instance has a GPU instance (its ``gpu_instance_id``) with a profile id and a placement, and ``create_mig`` adds an
instance to a running GPU the way a DRA driver's dynamic MIG does.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from gpuscaler.model.gpu_metrics import (
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_GRAPHICS_UTIL,
    GPM_NVLINK_TOTAL_RX_PER_SEC,
    GPM_NVLINK_TOTAL_TX_PER_SEC,
    GPM_PCIE_RX_PER_SEC,
    GPM_PCIE_TX_PER_SEC,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
)

INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NOT_FOUND = 6
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
NO_DATA = 21

NVML_GPM_METRICS_GET_VERSION = 1
NVML_GPM_METRIC_MAX = 477
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
ALL_LINKS = 0xFFFFFFFF  # a field value's scopeId for every NVLink at once

_MESSAGES = {
    INVALID_ARGUMENT: "Invalid Argument",
    NOT_SUPPORTED: "Not Supported",
    NOT_FOUND: "Not Found",
    TIMEOUT: "Timeout",
    LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    FUNCTION_NOT_FOUND: "Function Not Found",
    GPU_IS_LOST: "GPU is lost",
    NO_DATA: "No data",
}


def default_gpm() -> dict[int, float]:
    """A busy Hopper GPU's GPM metrics (by NVML_GPM_METRIC_* id): activity in percent, traffic in MiB/s."""
    return {
        GPM_GRAPHICS_UTIL: 88.0,
        GPM_SM_UTIL: 35.5,
        GPM_SM_OCCUPANCY: 22.25,
        GPM_ANY_TENSOR_UTIL: 12.5,
        GPM_DRAM_BW_UTIL: 48.0,
        GPM_PCIE_TX_PER_SEC: 1000.0,
        GPM_PCIE_RX_PER_SEC: 3000.0,
        GPM_NVLINK_TOTAL_RX_PER_SEC: 40000.0,
        GPM_NVLINK_TOTAL_TX_PER_SEC: 50000.0,
    }


@dataclass
class FakeProcess:
    """A compute process on a device; its utilisation samples are NVML's (microsecond timestamps)."""

    pid: int
    used_bytes: int | None = 1024**3
    # (timestamp in microseconds since the epoch, SM %, memory %), oldest first
    samples: list[tuple[int, int, int]] = field(default_factory=list)
    # (SM %, memory %) of a sample newer than any timestamp asked for: a process that keeps running
    live: tuple[int, int] | None = None


class FakeGpmSample:
    """An opaque GPM sample: which device filled it, with what, and in which order."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.device: FakeDevice | None = None
        self.values: dict[int, float] = {}
        self.taken = 0


class FakeGpmMetric:
    """One metric slot of the request: the caller sets metricId, nvmlGpmMetricsGet the nvmlReturn and value."""

    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = -1
        self.value = 0.0


class FakeGpmMetricsGet:
    """``c_nvmlGpmMetricsGet_t``: the request the caller fills and nvmlGpmMetricsGet answers in place."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: FakeGpmSample | None = None
        self.sample2: FakeGpmSample | None = None
        self.metrics = [FakeGpmMetric() for _ in range(NVML_GPM_METRIC_MAX)]


class NVMLError(Exception):
    """pynvml's error: ``value`` is NVML's return code, and str() is NVML's message for it."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"Unknown Error {self.value}")


@dataclass
class FakeDevice:
    """A GPU (or MIG instance) as NVML reports it, with the failures, hangs, GPM values and processes a test sets."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    gpu_percent: int = 40
    memory_percent: int = 20
    used_bytes: int = 40 * 1024**3
    total_bytes: int = 80 * 1024**3
    temperature: int = 55
    power_mw: int = 350_500
    limit_mw: int = 700_000
    # NVML function name -> return code it fails with
    errors: dict[str, int] = field(default_factory=dict)
    # NVML function names whose call blocks until `release` is set
    hang: set[str] = field(default_factory=set)
    release: threading.Event = field(default_factory=threading.Event)
    mig_instances: list[FakeDevice | None] | None = None  # None: MIG off; None entries are empty slots
    mig_mode_error: int | None = None
    energy_mj: int = 123_456_789
    # Draws this many watts: the energy counter is then watts x the wall clock, so it grows between reads.
    watts: float | None = None
    gpm_supported: bool = True  # Hopper or newer (of a MIG instance: its parent's)
    gpm: dict[int, float] = field(default_factory=default_gpm)
    gpm_metric_errors: dict[int, int] = field(default_factory=dict)  # metric id -> the nvmlReturn it gets
    gpu_instance_id: int = 0  # of a MIG instance
    minor: int | None = None  # /dev/nvidiaN of a GPU; None: its index (NVML's usual order, not a rule)
    gi_profile_id: int = 19  # of a MIG instance's GPU instance: NVML_GPU_INSTANCE_PROFILE_1_SLICE's id (1g.10gb)
    placement_start: int = 0
    placement_size: int = 1
    processes: list[FakeProcess] = field(default_factory=list)
    pcie_tx_kbps: int = 500_000  # nvmlDeviceGetPcieThroughput's KB/s (1024 bytes)
    pcie_rx_kbps: int = 1_000_000
    nvlink: bool = True  # has NVLink (an SXM board); False: a PCIe card without a bridge
    nvlink_links: int = 18
    # The NVLink throughput counters over all links, KiB since the driver loaded; a test advances them.
    nvlink_tx_kib: int = 0
    nvlink_rx_kib: int = 0
    field_errors: dict[int, int] = field(default_factory=dict)  # field id -> the nvmlReturn it gets


class FakeNvml:
    """The subset of pynvml that NvmlCollector uses; calls are counted per function name."""

    NVMLError = NVMLError
    NVML_GPM_METRICS_GET_VERSION = NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet  # noqa: N815 - pynvml's own name for the struct

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.initialised = False
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self.gpm_live: dict[int, FakeGpmSample] = {}
        self.gpm_allocated = 0
        self.gpm_freed = 0
        self._numbers = itertools.count(1)
        self._taken = itertools.count(1)
        # Holds nvmlGpmSampleGet until set, for tests of a GPM read that hangs while its device goes away.
        self.gpm_release: threading.Event | None = None
        self.gpm_waiting = threading.Event()

    def _device(self, function: str, handle: FakeDevice) -> FakeDevice:
        with self._lock:
            self.calls[function] = self.calls.get(function, 0) + 1
        if not self.initialised:
            raise NVMLError(1)
        if function in handle.hang:
            handle.release.wait(10)
        code = handle.errors.get(function)
        if code is not None:
            raise NVMLError(code)
        return handle

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        for device in self._all():
            if device.uuid == uuid:
                return self._device("nvmlDeviceGetHandleByUUID", device)
        raise NVMLError(NOT_FOUND)

    def _all(self) -> list[FakeDevice]:
        found = []
        for device in self.devices:
            found.append(device)
            found.extend(instance for instance in device.mig_instances or [] if instance is not None)
        return found

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetMigMode(self, handle: FakeDevice) -> list[int]:
        device = self._device("nvmlDeviceGetMigMode", handle)
        if device.mig_mode_error is not None:
            raise NVMLError(device.mig_mode_error)
        return [1, 1] if device.mig_instances is not None else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeDevice) -> int:
        return len(self._device("nvmlDeviceGetMaxMigDeviceCount", handle).mig_instances or [])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeDevice, slot: int) -> FakeDevice:
        instance = (self._device("nvmlDeviceGetMigDeviceHandleByIndex", handle).mig_instances or [])[slot]
        if instance is None:
            raise NVMLError(NOT_FOUND)
        return instance

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Any:
        device = self._device("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=device.gpu_percent, memory=device.memory_percent)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> Any:
        device = self._device("nvmlDeviceGetMemoryInfo" + ("_v2" if version else ""), handle)
        return SimpleNamespace(
            total=device.total_bytes, used=device.used_bytes, free=device.total_bytes - device.used_bytes
        )

    def nvmlDeviceGetTemperatureV(self, handle: FakeDevice, sensor: int) -> int:
        return self._device("nvmlDeviceGetTemperatureV", handle).temperature

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        return self._device("nvmlDeviceGetTemperature", handle).temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        return self._device("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeDevice) -> int:
        return self._device("nvmlDeviceGetEnforcedPowerLimit", handle).limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeDevice) -> int:
        device = self._device("nvmlDeviceGetTotalEnergyConsumption", handle)
        if device.watts is not None:
            return int(device.watts * time.time() * 1000)
        return device.energy_mj

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeDevice) -> int:
        return self._device("nvmlDeviceGetGpuInstanceId", handle).gpu_instance_id

    def nvmlDeviceGetMinorNumber(self, handle: FakeDevice) -> int:
        device = self._device("nvmlDeviceGetMinorNumber", handle)
        index = next((i for i, gpu in enumerate(self.devices) if gpu is device), None)
        if index is None:
            raise NVMLError(INVALID_ARGUMENT)  # a MIG instance has no /dev/nvidiaN of its own
        return device.minor if device.minor is not None else index

    def nvmlDeviceGetGpuInstanceById(self, handle: FakeDevice, gpu_instance_id: int) -> Any:
        parent = self._device("nvmlDeviceGetGpuInstanceById", handle)
        for instance in parent.mig_instances or []:
            if instance is not None and instance.gpu_instance_id == gpu_instance_id:
                return SimpleNamespace(parent=parent, instance=instance)
        raise NVMLError(NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any:
        instance = self._device("nvmlGpuInstanceGetInfo", gpu_instance.instance)
        return SimpleNamespace(
            device=gpu_instance.parent,
            id=instance.gpu_instance_id,
            profileId=instance.gi_profile_id,
            placement=SimpleNamespace(start=instance.placement_start, size=instance.placement_size),
        )

    def create_mig(self, index: int, instance: FakeDevice) -> None:
        """Make a MIG instance on GPU ``index`` now, in its first empty slot (or a new one): dynamic MIG."""
        parent = self.devices[index]
        with self._lock:
            slots = parent.mig_instances if parent.mig_instances is not None else []
            for slot, present in enumerate(slots):
                if present is None:
                    slots[slot] = instance
                    break
            else:
                slots.append(instance)
            parent.mig_instances = slots

    # PCIe and NVLink

    def nvmlDeviceGetPcieThroughput(self, handle: FakeDevice, counter: int) -> int:
        device = self._device("nvmlDeviceGetPcieThroughput", handle)
        return (device.pcie_tx_kbps, device.pcie_rx_kbps)[counter]

    def nvmlDeviceGetNvLinkState(self, handle: FakeDevice, link: int) -> int:
        device = self._device("nvmlDeviceGetNvLinkState", handle)
        if not device.nvlink:
            raise NVMLError(NOT_SUPPORTED)
        if not 0 <= link < device.nvlink_links:
            raise NVMLError(INVALID_ARGUMENT)
        return 1  # NVML_FEATURE_ENABLED

    def nvmlDeviceGetFieldValues(self, handle: FakeDevice, field_ids: list[tuple[int, int]]) -> list[Any]:
        device = self._device("nvmlDeviceGetFieldValues", handle)
        return [self._field_value(device, field_id, scope_id) for field_id, scope_id in field_ids]

    @staticmethod
    def _field_value(device: FakeDevice, field_id: int, scope_id: int) -> Any:
        counters = {
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: device.nvlink_tx_kib,
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: device.nvlink_rx_kib,
        }
        code, value = 0, 0
        if field_id in device.field_errors:
            code = device.field_errors[field_id]
        elif field_id not in counters or not device.nvlink:
            code = NOT_SUPPORTED
        elif scope_id == ALL_LINKS:
            value = counters[field_id]
        elif 0 <= scope_id < device.nvlink_links:
            value = counters[field_id] // device.nvlink_links
        else:
            code = INVALID_ARGUMENT
        return SimpleNamespace(
            fieldId=field_id, scopeId=scope_id, nvmlReturn=code, value=SimpleNamespace(ullVal=value if not code else 0)
        )

    # GPM

    def nvmlGpmQueryDeviceSupport(self, handle: FakeDevice) -> Any:
        device = self._device("nvmlGpmQueryDeviceSupport", handle)
        return SimpleNamespace(version=1, isSupportedDevice=1 if device.gpm_supported else 0)

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        with self._lock:
            self.calls["nvmlGpmSampleAlloc"] = self.calls.get("nvmlGpmSampleAlloc", 0) + 1
            sample = FakeGpmSample(next(self._numbers))
            self.gpm_live[sample.number] = sample
            self.gpm_allocated += 1
        return sample

    def nvmlGpmSampleFree(self, sample: FakeGpmSample) -> None:
        with self._lock:
            if self.gpm_live.pop(sample.number, None) is None:
                raise AssertionError(f"GPM sample {sample.number} freed twice, or never allocated")
            self.gpm_freed += 1

    def _live(self, sample: FakeGpmSample | None) -> FakeGpmSample:
        with self._lock:
            if sample is None or sample.number not in self.gpm_live:
                raise AssertionError("a GPM sample used after its free, or never allocated")
        return sample

    def _fill(self, sample: FakeGpmSample, device: FakeDevice) -> FakeGpmSample:
        if self.gpm_release is not None:
            self.gpm_waiting.set()
            self.gpm_release.wait(10)
        self._live(sample)
        sample.device, sample.values, sample.taken = device, dict(device.gpm), next(self._taken)
        return sample

    def nvmlGpmSampleGet(self, handle: FakeDevice, sample: FakeGpmSample) -> FakeGpmSample:
        device = self._device("nvmlGpmSampleGet", handle)
        if not device.gpm_supported:
            raise NVMLError(NOT_SUPPORTED)
        return self._fill(sample, device)

    def nvmlGpmMigSampleGet(self, handle: FakeDevice, gpu_instance_id: int, sample: FakeGpmSample) -> FakeGpmSample:
        parent = self._device("nvmlGpmMigSampleGet", handle)
        if not parent.gpm_supported:
            raise NVMLError(NOT_SUPPORTED)
        for instance in parent.mig_instances or []:
            if instance is not None and instance.gpu_instance_id == gpu_instance_id:
                return self._fill(sample, self._device("nvmlGpmMigSampleGet", instance))
        raise NVMLError(NOT_FOUND)

    def nvmlGpmMetricsGet(self, request: FakeGpmMetricsGet) -> FakeGpmMetricsGet:
        with self._lock:
            self.calls["nvmlGpmMetricsGet"] = self.calls.get("nvmlGpmMetricsGet", 0) + 1
        first, second = self._live(request.sample1), self._live(request.sample2)
        if request.version != NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(25)  # ARGUMENT_VERSION_MISMATCH
        if first.device is None or first.device is not second.device or first.taken >= second.taken:
            raise NVMLError(2)  # INVALID_ARGUMENT: two samples of one device, the older first
        for metric in request.metrics[: request.numMetrics]:
            code = second.device.gpm_metric_errors.get(metric.metricId)
            if code is not None:
                metric.nvmlReturn, metric.value = code, 0.0
            elif metric.metricId in second.values:
                metric.nvmlReturn, metric.value = 0, second.values[metric.metricId]
            else:
                metric.nvmlReturn, metric.value = NOT_SUPPORTED, 0.0
        return request

    # Processes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[Any]:
        device = self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        return [
            SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_bytes, gpuInstanceId=0, computeInstanceId=0)
            for p in device.processes
        ]

    def _utilization(self, function: str, handle: FakeDevice, since: int) -> list[Any]:
        device = self._device(function, handle)
        found = [
            SimpleNamespace(pid=p.pid, timeStamp=stamp, smUtil=sm, memUtil=mem, encUtil=0, decUtil=0)
            for p in device.processes
            for stamp, sm, mem in [*p.samples, *([(since + 1, *p.live)] if p.live else [])]
            if stamp > since
        ]
        if not found:
            raise NVMLError(NOT_FOUND)  # NVML's answer when no process ran since the timestamp
        return found

    def nvmlDeviceGetProcessesUtilizationInfo(self, handle: FakeDevice, since: int) -> list[Any]:
        return self._utilization("nvmlDeviceGetProcessesUtilizationInfo", handle, since)

    def nvmlDeviceGetProcessUtilization(self, handle: FakeDevice, since: int) -> list[Any]:
        return self._utilization("nvmlDeviceGetProcessUtilization", handle, since)
