"""A fake ``pynvml`` module: the calls NvmlCollector makes, over GPUs described in plain data.

Each device can be told to raise an NVML error per call (by NVML return code), to hang, or to be
MIG-enabled with instances. Codes are NVML's own (3 NotSupported, 13 FunctionNotFound, 15 GpuIsLost...).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NOT_SUPPORTED = 3
NOT_FOUND = 6
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15

_MESSAGES = {
    NOT_SUPPORTED: "Not Supported",
    NOT_FOUND: "Not Found",
    TIMEOUT: "Timeout",
    LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    FUNCTION_NOT_FOUND: "Function Not Found",
    GPU_IS_LOST: "GPU is lost",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"Unknown Error {self.value}")


@dataclass
class FakeDevice:
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


class FakeNvml:
    """The subset of pynvml that NvmlCollector uses; calls are counted per function name."""

    NVMLError = NVMLError

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.initialised = False
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

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
