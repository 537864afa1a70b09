"""The NVML collector: nvidia-ml-py calls, with each NVML error kept beside the value it cost.

The ``pynvml`` module is injected, so tests drive this class with a hand-written fake NVML.
Error details name the call and the device, the way dcgm-exporter does:
``nvmlDeviceGetUtilizationRates(gpu 3): GPU is lost`` (``nvml_calls.py`` times each call and keeps its error;
``nvml_readings.py`` has the readings that older drivers answer with another call).

GPM metrics (Hopper and newer) are rates between two GPM samples, so the collector keeps each device's
previous sample (``gpm.py``): the first tick has none and reads them as absent, never 0. PCIe and NVLink
traffic comes from GPM too, or, on a GPU without it, from NVML's older calls (``interconnect.py``).
Per-process utilisation and memory (``--processes``) are read per device and tied to pods through ``/proc``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpuscaler.agent.attribution.processes import ProcReader
from gpuscaler.agent.collectors.base import CollectorUnavailable
from gpuscaler.agent.collectors.gpm import GPM_FIELDS, GRAPHICS_PERCENT, GpmReader
from gpuscaler.agent.collectors.interconnect import NVLINK_RX, NVLINK_TX, PCIE_RX, PCIE_TX, InterconnectReader
from gpuscaler.agent.collectors.nvml_calls import (
    FUNCTION_NOT_FOUND,
    NOT_FOUND,
    NOT_SUPPORTED,
    CallObserver,
    FieldReader,
    describe_error,
    error_kind,
    text,
    where,
)
from gpuscaler.agent.collectors.nvml_identity import Placement, mig_placement, minor_number
from gpuscaler.agent.collectors.nvml_readings import process_utilization, read_memory_info, read_temperature
from gpuscaler.model.samples import (
    DEVICE_FIELD,
    PROCESSES_FIELD,
    GpuIdentity,
    GpuSample,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
)

log = structlog.get_logger(__name__)

START_HINT = (
    "run the agent with the NVIDIA container runtime (the chart's agent.runtimeClassName: nvidia), or mount the "
    "driver with the chart's agent.nvmlHostMounts.enabled=true, or use --collector fake for development"
)


# NVML keeps per-process utilisation samples at the driver's sample period (1/6 s to 1 s); asking for the
# newest sample of the last two seconds finds one for every process that ran, whatever the poll interval.
PROCESS_LOOKBACK_SECONDS = 2.0


class NvmlCollector:
    """Samples every GPU (and every MIG instance) that NVML enumerates.

    ``processes`` turns on per-process reads, with ``/proc`` read through it (a ProcReader; tests point
    one at a fixture tree). ``wall_clock`` is the clock NVML's per-process timestamps count in; ``clock`` the
    monotonic one that NVLink counters' rates are taken in.
    """

    def __init__(
        self,
        *,
        node: str,
        nvml: object | None = None,
        on_call: CallObserver | None = None,
        processes: ProcReader | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml: Any = nvml
        self._node = node
        self._handles: dict[str, Any] = {}
        self._parents: dict[str, Any] = {}
        # Each device's minor number and MIG placement by UUID, read at its first enumeration: a MIG instance made
        # again gets a new UUID, so a cached fact never outlives its device.
        self._minors: dict[str, int | None] = {}
        self._placements: dict[str, Placement] = {}
        self._placement_refused = False
        self._lock = threading.Lock()
        self.on_call = on_call
        self._gpm = GpmReader(self._nvml)
        self._interconnect = InterconnectReader(self._nvml, clock)
        self._processes = processes
        self._wall_clock = wall_clock

    @property
    def node(self) -> str:
        return self._node

    def open(self) -> None:
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as error:
            raise CollectorUnavailable(f"NVML is not available ({describe_error(error)}): {START_HINT}") from None

    def close(self) -> None:
        self._gpm.close()  # frees every GPM sample NVML allocated for us, before NVML goes
        with contextlib.suppress(self._nvml.NVMLError):  # shutting down anyway; nothing a caller could do
            self._nvml.nvmlShutdown()

    def discover(self) -> Sequence[GpuIdentity]:
        try:
            return self._discover()
        except self._nvml.NVMLError as error:
            raise CollectorUnavailable(
                f"NVML could not list the GPUs ({describe_error(error)}): {START_HINT}"
            ) from None

    def _discover(self) -> Sequence[GpuIdentity]:
        nvml = self._nvml
        devices: list[GpuIdentity] = []
        handles: dict[str, Any] = {}
        parents: dict[str, Any] = {}
        minors: dict[str, int | None] = {}
        placements: dict[str, Placement] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
            name = text(nvml.nvmlDeviceGetName(handle))
            minor = minors[uuid] = self._minors[uuid] if uuid in self._minors else minor_number(nvml, handle)
            instances = self._mig_instances(handle)
            if instances is None:
                devices.append(GpuIdentity(index=index, uuid=uuid, name=name, minor=minor))
                handles[uuid] = handle
                continue
            for slot, mig_handle in instances:
                mig_uuid = text(nvml.nvmlDeviceGetUUID(mig_handle))
                mig_name = text(nvml.nvmlDeviceGetName(mig_handle))
                placement = self._placements.get(mig_uuid)
                if placement is None:
                    placement = mig_placement(nvml, handle, mig_handle)
                    if placement.problem is not None and not self._placement_refused:
                        self._placement_refused = True  # once: every instance on the node is refused alike
                        log.warning("mig_placement_unreadable", device=mig_uuid, reason=placement.problem)
                placements[mig_uuid] = placement
                devices.append(
                    GpuIdentity(
                        index=index,
                        uuid=mig_uuid,
                        name=mig_name,
                        mig_parent_uuid=uuid,
                        minor=minor,
                        gpu_instance_id=placement.gpu_instance_id,
                        gpu_instance_profile_id=placement.profile_id,
                        placement_start=placement.start,
                        placement_problem=placement.problem,
                        mig_slot=slot,
                    )
                )
                handles[mig_uuid] = mig_handle
                parents[mig_uuid] = handle
        with self._lock:
            self._handles, self._parents = handles, parents
        self._minors, self._placements = minors, placements
        self._gpm.keep_only(set(handles))  # a device that went (a MIG change) gives back its GPM samples
        self._interconnect.keep_only(set(handles))
        return devices

    def _mig_instances(self, handle: Any) -> list[tuple[int, Any]] | None:
        """The MIG instance handles of a MIG-enabled GPU by slot, or None when MIG is off or unsupported."""
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as error:
            if error.value in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                return None
            raise
        if current != 1:  # NVML_DEVICE_MIG_ENABLE
            return None
        instances = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                instances.append((slot, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)))
            except nvml.NVMLError as error:
                if error.value == NOT_FOUND:  # an empty slot; later slots may be filled
                    continue
                raise
        return instances

    def read(self, gpu: GpuIdentity) -> GpuSample:
        nvml = self._nvml
        handle = self._handle(gpu)
        if isinstance(handle, ReadError):
            return GpuSample(gpu=gpu, node=self._node, errors=(handle,))
        reader = FieldReader(nvml, gpu, self.on_call)
        is_mig = gpu.mig_parent_uuid is not None
        physical = self._parents.get(gpu.uuid, handle) if is_mig else handle

        utilization = reader.call(
            ("gpu_utilization_percent", "memory_utilization_percent"),
            "nvmlDeviceGetUtilizationRates",
            lambda: nvml.nvmlDeviceGetUtilizationRates(handle),
        )
        memory = reader.call(
            ("memory_used_bytes", "memory_total_bytes"),
            "nvmlDeviceGetMemoryInfo",
            lambda: read_memory_info(nvml, handle),
        )
        temperature = reader.call(
            ("temperature_celsius",), "nvmlDeviceGetTemperatureV", lambda: read_temperature(nvml, physical)
        )
        if is_mig:
            # The board's power is shared by every instance; summing it per instance would multiply it.
            reader.absent(
                ("power_draw_watts", "power_limit_watts"),
                ReadErrorKind.NOT_SUPPORTED,
                "power is measured per physical GPU, not per MIG instance",
            )
            power_mw = limit_mw = None
        else:
            power_mw = reader.call(
                ("power_draw_watts",), "nvmlDeviceGetPowerUsage", lambda: nvml.nvmlDeviceGetPowerUsage(handle)
            )
            limit_mw = reader.call(
                ("power_limit_watts",),
                "nvmlDeviceGetEnforcedPowerLimit",
                lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle),
            )
        if is_mig:
            reader.absent(
                ("energy_joules",),
                ReadErrorKind.NOT_SUPPORTED,
                "energy is counted per physical GPU, not per MIG instance",
            )
            energy_mj = None
        else:
            energy_mj = reader.call(
                ("energy_joules",),
                "nvmlDeviceGetTotalEnergyConsumption",
                lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle),
            )
        if reader.device_gone:  # asking a lost GPU for more would only repeat NVML's answer
            reader.absent(GPM_FIELDS, ReadErrorKind.GPU_LOST, f"{where(gpu)} was lost during this read")
            gpm: dict[str, float] = {}
            traffic: dict[str, float] = {}
        else:
            # Traffic a device has none of (a MIG instance, a GPU without NVLink) is settled first: GPM would read 0.
            no_traffic = self._interconnect.unreadable(gpu, handle, reader)
            gpm = self._gpm.read(gpu, handle, physical, reader, skip=no_traffic)
            if self._gpm.supported(gpu.uuid):
                traffic = gpm
            else:
                traffic = self._interconnect.read(gpu, handle, reader, skip=no_traffic)
        if is_mig and utilization is None and gpm.get(GRAPHICS_PERCENT) is not None:
            # NVML has no utilisation per MIG instance; GPM's graphics activity is the same duty cycle, per
            # instance. Keep NVML's refusal out of the errors: the value is there.
            reader.errors = [e for e in reader.errors if e.field != "gpu_utilization_percent"]
            gpu_percent: float | None = gpm[GRAPHICS_PERCENT]
        else:
            gpu_percent = None if utilization is None else float(utilization.gpu)
        processes = self._read_processes(gpu, handle, reader) if not reader.device_gone else None
        if reader.device_gone:
            self._forget(gpu)
        return GpuSample(
            gpu=gpu,
            node=self._node,
            gpu_utilization_percent=gpu_percent,
            memory_utilization_percent=None if utilization is None else float(utilization.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            temperature_celsius=None if temperature is None else float(temperature),
            power_draw_watts=None if power_mw is None else power_mw / 1000.0,
            power_limit_watts=None if limit_mw is None else limit_mw / 1000.0,
            sm_active_percent=gpm.get("sm_active_percent"),
            sm_occupancy_percent=gpm.get("sm_occupancy_percent"),
            tensor_active_percent=gpm.get("tensor_active_percent"),
            dram_bandwidth_percent=gpm.get("dram_bandwidth_percent"),
            energy_joules=None if energy_mj is None else energy_mj / 1000.0,
            pcie_tx_megabytes_per_second=traffic.get(PCIE_TX),
            pcie_rx_megabytes_per_second=traffic.get(PCIE_RX),
            nvlink_tx_megabytes_per_second=traffic.get(NVLINK_TX),
            nvlink_rx_megabytes_per_second=traffic.get(NVLINK_RX),
            errors=tuple(reader.errors),
            processes=processes,
        )

    def _read_processes(self, gpu: GpuIdentity, handle: Any, reader: FieldReader) -> tuple[ProcessUsage, ...] | None:
        """Every compute process on the device with its utilisation, memory and pod; None when off or unreadable."""
        if self._processes is None:
            return None
        nvml = self._nvml
        running = reader.call(
            (PROCESSES_FIELD,),
            "nvmlDeviceGetComputeRunningProcesses",
            lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle),
        )
        if running is None:
            return None
        since = int((self._wall_clock() - PROCESS_LOOKBACK_SECONDS) * 1_000_000)
        utilization = process_utilization(nvml, handle, since, reader)
        memory = {int(p.pid): p.usedGpuMemory for p in running}
        pids = sorted(set(memory) | (set(utilization) if utilization is not None else set()))
        usages = []
        visible = 0
        for pid in pids:
            container = self._processes.container(pid)
            visible += container is not None
            sm, mem = (None, None) if utilization is None else utilization.get(pid, (0.0, 0.0))
            used = memory.get(pid)
            usages.append(
                ProcessUsage(
                    pid=pid,
                    pod_uid=None if container is None else container.pod_uid,
                    container_id=None if container is None or not container.container_id else container.container_id,
                    sm_percent=sm,
                    memory_utilization_percent=mem,
                    memory_used_bytes=None if used is None else int(used),
                )
            )
        if pids and not visible:
            # NVML's PIDs are the host's: without its PID namespace none of them is in our /proc.
            reader.absent(
                (PROCESSES_FIELD,),
                ReadErrorKind.NOT_SUPPORTED,
                f"none of the {len(pids)} processes NVML lists on {where(gpu)} is visible under "
                f"{str(self._processes.proc_root)!r}: per-process reads need the host's PID namespace (the chart's "
                "agent.processes.enabled sets hostPID)",
            )
            return None
        return tuple(usages)

    def _handle(self, gpu: GpuIdentity) -> Any:
        """The cached handle, or a fresh one by UUID after the GPU was lost; a ReadError when there is none."""
        with self._lock:
            handle = self._handles.get(gpu.uuid)
        if handle is not None:
            return handle
        try:
            handle = self._nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        except self._nvml.NVMLError as error:
            return ReadError(
                DEVICE_FIELD, error_kind(error), f"nvmlDeviceGetHandleByUUID({gpu.uuid}): {describe_error(error)}"
            )
        with self._lock:
            self._handles[gpu.uuid] = handle
        return handle

    def _forget(self, gpu: GpuIdentity) -> None:
        with self._lock:
            self._handles.pop(gpu.uuid, None)
        self._gpm.forget(gpu.uuid)  # its previous GPM sample is from before the loss: no rate across it
        self._interconnect.forget(gpu.uuid)  # and its NVLink counters
