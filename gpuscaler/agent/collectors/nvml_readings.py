"""NVML readings that take more than one call: what older drivers answer instead, and each process's newest
utilisation sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuscaler.agent.collectors.nvml_calls import FUNCTION_NOT_FOUND, NOT_FOUND, FieldReader
from gpuscaler.model.samples import ReadErrorKind

_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_MEMORY_V2 = 0x02000028  # nvmlMemory_v2: `used` matches nvidia-smi (excludes reserved memory)


def process_utilization(
    nvml: Any, handle: Any, since: int, reader: FieldReader
) -> dict[int, tuple[float, float]] | None:
    """Each process's newest (SM %, memory %) since ``since`` (microseconds); None when NVML has no such figures.

    NVML reports only the processes that ran since then: a process it lists as running and leaves out here
    ran no kernel, which the caller reads as 0. NOT_FOUND is NVML's "no process ran"; drivers before
    nvmlDeviceGetProcessesUtilizationInfo have nvmlDeviceGetProcessUtilization instead.
    """

    def newest(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except nvml.NVMLError as error:
            # pynvml raises a bare NVMLError(0) when the driver answers "success, no samples" to its size query.
            if error.value in (NOT_FOUND, 0):
                return []
            raise

    fields = ("process_utilization",)
    samples = reader.call(
        fields,
        "nvmlDeviceGetProcessesUtilizationInfo",
        lambda: newest(lambda: nvml.nvmlDeviceGetProcessesUtilizationInfo(handle, since)),
    )
    if samples is None and reader.errors and reader.errors[-1].kind is ReadErrorKind.NOT_SUPPORTED:
        reader.errors.pop()  # an older driver: the older call answers the same question
        samples = reader.call(
            fields,
            "nvmlDeviceGetProcessUtilization",
            lambda: newest(lambda: nvml.nvmlDeviceGetProcessUtilization(handle, since)),
        )
    if samples is None:
        return None
    found: dict[int, tuple[int, float, float]] = {}
    for sample in samples:
        pid, stamp = int(sample.pid), int(sample.timeStamp)
        if pid not in found or stamp > found[pid][0]:
            found[pid] = (stamp, float(sample.smUtil), float(sample.memUtil))
    return {pid: (sm, mem) for pid, (_stamp, sm, mem) in found.items()}


def read_memory_info(nvml: Any, handle: Any) -> Any:
    """The device's v2 memory info, or v1 from a driver without v2."""
    try:
        return nvml.nvmlDeviceGetMemoryInfo(handle, version=_MEMORY_V2)
    except nvml.NVMLError as error:
        if error.value != FUNCTION_NOT_FOUND:
            raise
        return nvml.nvmlDeviceGetMemoryInfo(handle)  # drivers before v2 memory info


def read_temperature(nvml: Any, handle: Any) -> Any:
    """The die temperature, by ``nvmlDeviceGetTemperatureV`` or, on older drivers, ``nvmlDeviceGetTemperature``."""
    try:
        return nvml.nvmlDeviceGetTemperatureV(handle, _TEMPERATURE_GPU)
    except nvml.NVMLError as error:
        if error.value != FUNCTION_NOT_FOUND:
            raise
        return nvml.nvmlDeviceGetTemperature(handle, _TEMPERATURE_GPU)
