"""NVML's return codes and one device's calls: each timed for the agent's series, and each failure kept as a
ReadError beside the fields it cost, naming the call and the device (``nvmlDeviceGetPowerUsage(gpu 3): GPU is lost``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuscaler.model.samples import GpuIdentity, ReadError, ReadErrorKind

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
NOT_FOUND = 6

DEVICE_GONE = {GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND}

CallObserver = Callable[[str, float, "int | None"], None]  # NVML function, seconds, error code or None


class FieldReader:
    """Calls NVML for some fields of one device and keeps one ReadError per field that failed."""

    def __init__(self, nvml: Any, gpu: GpuIdentity, on_call: CallObserver | None) -> None:
        self._nvml = nvml
        self._gpu = gpu
        self._on_call = on_call
        self.errors: list[ReadError] = []
        self.device_gone = False
        self.where = where(gpu)

    def call(self, fields: Sequence[str], name: str, function: Callable[[], Any]) -> Any:
        result, code = self.attempt(name, function)
        if code is not None:
            self.failed(fields, name, code)
        return result

    def attempt(self, name: str, function: Callable[[], Any]) -> tuple[Any, int | None]:
        started = time.perf_counter()
        try:
            result = function()
        except self._nvml.NVMLError as error:
            code = int(getattr(error, "value", -1))
            self._observe(name, started, code)
            if code in DEVICE_GONE:
                self.device_gone = True
            return None, code
        self._observe(name, started, None)
        return result, None

    def failed(self, fields: Sequence[str], name: str, code: int) -> None:
        self.absent(fields, error_kind(Code(code)), f"{name}({self.where}): {self.describe(code)}")

    def describe(self, code: int) -> str:
        return describe_error(self._nvml.NVMLError(code))

    def _observe(self, name: str, started: float, error_code: int | None) -> None:
        if self._on_call is not None:
            self._on_call(name, time.perf_counter() - started, error_code)

    def absent(self, fields: Sequence[str], kind: ReadErrorKind, detail: str) -> None:
        self.errors.extend(ReadError(field, kind, detail) for field in fields)


class Code:
    """An NVML return code where an error object is expected (a GPM metric's own return code)."""

    def __init__(self, value: int) -> None:
        self.value = value


def where(gpu: GpuIdentity) -> str:
    """The device as error details name it: ``gpu 3``, or ``mig MIG-…`` for an instance."""
    return f"mig {gpu.uuid}" if gpu.mig_parent_uuid else f"gpu {gpu.index}"


def error_kind(error: Any) -> ReadErrorKind:
    """What an NVML error (or a bare return code in ``.value``) means for the reading it cost."""
    code = getattr(error, "value", None)
    if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
        return ReadErrorKind.NOT_SUPPORTED
    if code in DEVICE_GONE:
        return ReadErrorKind.GPU_LOST
    if code == TIMEOUT:
        return ReadErrorKind.TIMEOUT
    return ReadErrorKind.OTHER


def describe_error(error: Any) -> str:
    """NVML's words for the error, with its return code."""
    return f"{error} (NVML error {getattr(error, 'value', '?')})"


def text(value: str | bytes) -> str:
    """A string NVML returns, as ``str`` whichever nvidia-ml-py gives."""
    return value.decode() if isinstance(value, bytes) else value
