"""The NVML collector: nvidia-ml-py calls, with each NVML error kept beside the value it cost.

The ``pynvml`` module is injected, so tests drive this class with a hand-written fake NVML.
Error details name the call and the device, the way dcgm-exporter does:
``nvmlDeviceGetUtilizationRates(gpu 3): GPU is lost``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuscaler.collectors.base import CollectorUnavailable
from gpuscaler.samples import DEVICE_FIELD, GpuIdentity, GpuSample, ReadError, ReadErrorKind

# NVML return codes (nvml.h); named here so a fake module needs only NVMLError with `.value`.
NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
GPU_NOT_FOUND = 28

_DEVICE_GONE = {GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND}
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_MEMORY_V2 = 0x02000028  # nvmlMemory_v2: `used` matches nvidia-smi (excludes reserved memory)

CallObserver = Callable[[str, float, "int | None"], None]  # NVML function, seconds, error code or None

START_HINT = (
    "run the agent with the NVIDIA container runtime (the chart's agent.runtimeClassName: nvidia), or mount the "
    "driver with the chart's agent.nvmlHostMounts.enabled=true, or use --collector fake for development"
)


class NvmlCollector:
    """Samples every GPU (and every MIG instance) that NVML enumerates."""

    def __init__(self, *, node: str, nvml: object | None = None, on_call: CallObserver | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml: Any = nvml
        self._node = node
        self._handles: dict[str, Any] = {}
        self._parents: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.on_call = on_call

    @property
    def node(self) -> str:
        return self._node

    def open(self) -> None:
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as error:
            raise CollectorUnavailable(f"NVML is not available ({_describe(error)}): {START_HINT}") from None

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):  # shutting down anyway; nothing a caller could do
            self._nvml.nvmlShutdown()

    def discover(self) -> Sequence[GpuIdentity]:
        try:
            return self._discover()
        except self._nvml.NVMLError as error:
            raise CollectorUnavailable(f"NVML could not list the GPUs ({_describe(error)}): {START_HINT}") from None

    def _discover(self) -> Sequence[GpuIdentity]:
        nvml = self._nvml
        devices: list[GpuIdentity] = []
        handles: dict[str, Any] = {}
        parents: dict[str, Any] = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            instances = self._mig_instances(handle)
            if instances is None:
                devices.append(GpuIdentity(index=index, uuid=uuid, name=name))
                handles[uuid] = handle
                continue
            for mig_handle in instances:
                mig_uuid = _text(nvml.nvmlDeviceGetUUID(mig_handle))
                mig_name = _text(nvml.nvmlDeviceGetName(mig_handle))
                devices.append(GpuIdentity(index=index, uuid=mig_uuid, name=mig_name, mig_parent_uuid=uuid))
                handles[mig_uuid] = mig_handle
                parents[mig_uuid] = handle
        with self._lock:
            self._handles, self._parents = handles, parents
        return devices

    def _mig_instances(self, handle: Any) -> list[Any] | None:
        """The MIG instance handles of a MIG-enabled GPU, or None when MIG is off or unsupported."""
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
                instances.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
            except nvml.NVMLError as error:
                if error.value == 6:  # NOT_FOUND: an empty slot; later slots may be filled
                    continue
                raise
        return instances

    def read(self, gpu: GpuIdentity) -> GpuSample:
        nvml = self._nvml
        handle = self._handle(gpu)
        if isinstance(handle, ReadError):
            return GpuSample(gpu=gpu, node=self._node, errors=(handle,))
        reader = _FieldReader(nvml, gpu, self.on_call)
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
            lambda: _memory_info(nvml, handle),
        )
        temperature = reader.call(
            ("temperature_celsius",), "nvmlDeviceGetTemperatureV", lambda: _temperature(nvml, physical)
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
        if reader.device_gone:
            self._forget(gpu)
        return GpuSample(
            gpu=gpu,
            node=self._node,
            gpu_utilization_percent=None if utilization is None else float(utilization.gpu),
            memory_utilization_percent=None if utilization is None else float(utilization.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            temperature_celsius=None if temperature is None else float(temperature),
            power_draw_watts=None if power_mw is None else power_mw / 1000.0,
            power_limit_watts=None if limit_mw is None else limit_mw / 1000.0,
            errors=tuple(reader.errors),
        )

    def _handle(self, gpu: GpuIdentity) -> Any:
        """The cached handle, or a fresh one by UUID after the GPU was lost; a ReadError when there is none."""
        with self._lock:
            handle = self._handles.get(gpu.uuid)
        if handle is not None:
            return handle
        try:
            handle = self._nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        except self._nvml.NVMLError as error:
            return ReadError(DEVICE_FIELD, _kind(error), f"nvmlDeviceGetHandleByUUID({gpu.uuid}): {_describe(error)}")
        with self._lock:
            self._handles[gpu.uuid] = handle
        return handle

    def _forget(self, gpu: GpuIdentity) -> None:
        with self._lock:
            self._handles.pop(gpu.uuid, None)


class _FieldReader:
    """Calls NVML for some fields of one device and keeps one ReadError per field that failed."""

    def __init__(self, nvml: Any, gpu: GpuIdentity, on_call: CallObserver | None) -> None:
        self._nvml = nvml
        self._gpu = gpu
        self._on_call = on_call
        self.errors: list[ReadError] = []
        self.device_gone = False

    def call(self, fields: Sequence[str], name: str, function: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            result = function()
        except self._nvml.NVMLError as error:
            self._observe(name, started, getattr(error, "value", -1))
            if error.value in _DEVICE_GONE:
                self.device_gone = True
            where = f"mig {self._gpu.uuid}" if self._gpu.mig_parent_uuid else f"gpu {self._gpu.index}"
            self.absent(fields, _kind(error), f"{name}({where}): {_describe(error)}")
            return None
        self._observe(name, started, None)
        return result

    def _observe(self, name: str, started: float, error_code: int | None) -> None:
        if self._on_call is not None:
            self._on_call(name, time.perf_counter() - started, error_code)

    def absent(self, fields: Sequence[str], kind: ReadErrorKind, detail: str) -> None:
        self.errors.extend(ReadError(field, kind, detail) for field in fields)


def _memory_info(nvml: Any, handle: Any) -> Any:
    try:
        return nvml.nvmlDeviceGetMemoryInfo(handle, version=_MEMORY_V2)
    except nvml.NVMLError as error:
        if error.value != FUNCTION_NOT_FOUND:
            raise
        return nvml.nvmlDeviceGetMemoryInfo(handle)  # drivers before v2 memory info


def _temperature(nvml: Any, handle: Any) -> Any:
    try:
        return nvml.nvmlDeviceGetTemperatureV(handle, _TEMPERATURE_GPU)
    except nvml.NVMLError as error:
        if error.value != FUNCTION_NOT_FOUND:
            raise
        return nvml.nvmlDeviceGetTemperature(handle, _TEMPERATURE_GPU)


def _kind(error: Any) -> ReadErrorKind:
    code = getattr(error, "value", None)
    if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
        return ReadErrorKind.NOT_SUPPORTED
    if code in _DEVICE_GONE:
        return ReadErrorKind.GPU_LOST
    if code == TIMEOUT:
        return ReadErrorKind.TIMEOUT
    return ReadErrorKind.OTHER


def _describe(error: Any) -> str:
    return f"{error} (NVML error {getattr(error, 'value', '?')})"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
