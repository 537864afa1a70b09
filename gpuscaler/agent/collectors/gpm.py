"""GPM (GPU Performance Monitoring, Hopper and newer): each device's previous sample, and the rates between two.

A GPM metric is computed by NVML from two samples of one device, so the reader keeps each device's
previous sample in a buffer NVML allocated; the first tick has no previous sample, and its GPM values are
absent with that reason, never 0. A MIG instance is sampled through its parent (``nvmlGpmMigSampleGet``
with the instance's GPU instance id). The buffers are freed exactly once: when the device goes (a lost
GPU, a MIG change), when the collector closes, and, if a read still uses them then (a hung NVML call),
by that read on its way out.

Where GPM is not there, its readings are absent NOT_SUPPORTED, except those with a ``Reading.fallback``:
the caller reads them with the older NVML call instead (``interconnect.py``), so this reader leaves them alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

from gpuscaler.model.gpu_metrics import GPM_GRAPHICS_UTIL, GPM_READINGS, Reading
from gpuscaler.model.samples import GpuIdentity, ReadErrorKind

# The key of GPM's graphics activity in ``GpmReader.read``'s answer: a MIG instance's utilisation.
GRAPHICS_PERCENT = "graphics_percent"
GPM_FIELDS: tuple[str, ...] = tuple(reading.field for reading in GPM_READINGS)
NOT_SUPPORTED_HINT = (
    "GPM needs a Hopper or newer GPU (and a driver that has it); on this GPU scale on gpu_utilization, "
    "or use a profile without -gpm"
)


# NVML's NOT_SUPPORTED and FUNCTION_NOT_FOUND: GPM is not there, and asking again will not change that.
_UNSUPPORTED_CODES = frozenset({3, 13})
# What ``_unsupported`` answers when the support query failed in a way that may pass (its error is recorded).
UNKNOWN = ""


class Calls(Protocol):
    """The collector's per-read bookkeeping: NVML calls with their errors kept beside the fields they cost."""

    where: str

    def call(self, fields: Sequence[str], name: str, function: Callable[[], Any]) -> Any:
        """``function()``, or None with an error recorded for each of ``fields``."""

    def attempt(self, name: str, function: Callable[[], Any]) -> tuple[Any, int | None]:
        """``(function(), None)``, or ``(None, NVML's error code)`` with nothing recorded."""

    def absent(self, fields: Sequence[str], kind: ReadErrorKind, detail: str) -> None:
        """Record ``fields`` as absent for this reason."""

    def failed(self, fields: Sequence[str], name: str, code: int) -> None:
        """Record ``fields`` as absent because NVML's ``name`` answered ``code``."""

    def describe(self, code: int) -> str:
        """NVML's words for ``code``, with the code."""


class _Buffers:
    """One device's two GPM sample buffers: the previous tick's and the one this tick fills."""

    def __init__(self, nvml: Any, previous: Any, current: Any) -> None:
        self._nvml = nvml
        self.previous = previous
        self.current = current
        self.has_previous = False
        self._flag = threading.Lock()
        self._busy = False
        self._retired = False
        self._freed = False

    @contextlib.contextmanager
    def using(self) -> Iterator[bool]:
        """Holds the buffers for one read; yields False when they are retired or another read holds them."""
        with self._flag:
            usable = not self._retired and not self._busy
            if usable:
                self._busy = True
        if not usable:
            yield False
            return
        try:
            yield True
        finally:
            with self._flag:
                self._busy = False
                free = self._retired
            if free:
                self._free()

    def swap(self) -> None:
        """The sample just filled becomes the previous one; the old previous is filled next time."""
        self.previous, self.current = self.current, self.previous
        self.has_previous = True

    def retire(self) -> None:
        """Free now, or, while a read holds the buffers, when it lets go of them."""
        with self._flag:
            self._retired = True
            busy = self._busy
        if not busy:
            self._free()

    def _free(self) -> None:
        with self._flag:
            if self._freed:
                return
            self._freed = True
        for sample in (self.previous, self.current):
            # After nvmlShutdown the library refuses (a hung read that returned late): nothing left to do.
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlGpmSampleFree(sample)


class GpmReader:
    """Reads the GPM metrics of ``gpu_metrics.GPM_READINGS`` per device, keeping each device's previous sample."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._buffers: dict[str, _Buffers] = {}
        self._support: dict[str, str | None] = {}  # uuid -> None when GPM works, else why not
        self._instance_ids: dict[str, int] = {}

    def read(
        self, gpu: GpuIdentity, handle: Any, physical: Any, calls: Calls, skip: Collection[str] = ()
    ) -> dict[str, float]:
        """The device's GPM metrics by sample field, in its unit (and ``GRAPHICS_PERCENT`` for a MIG instance).

        A field that is not in the answer has its reason in ``calls``: unsupported, the first sample, an error.
        ``skip`` names fields the caller settles itself for this device: they are neither asked nor recorded.
        """
        readings = [reading for reading in GPM_READINGS if reading.field not in skip]
        fields = [reading.field for reading in readings]
        unsupported = self._unsupported(gpu, physical, calls, readings)
        if unsupported == UNKNOWN:
            return {}
        if unsupported is not None:
            calls.absent(
                [reading.field for reading in readings if reading.fallback is None],
                ReadErrorKind.NOT_SUPPORTED,
                unsupported,
            )
            return {}
        is_mig = gpu.mig_parent_uuid is not None
        instance = self._instance_id(gpu, handle, calls, fields) if is_mig else None
        if is_mig and instance is None:
            return {}
        buffers = self._buffers_of(gpu, calls, fields)
        if buffers is None:
            return {}
        with buffers.using() as usable:
            if not usable:
                calls.absent(fields, ReadErrorKind.TIMEOUT, "the previous GPM read of this device has not returned")
                return {}
            return self._sample(gpu, physical, instance, buffers, calls, readings)

    def supported(self, uuid: str) -> bool:
        """Whether GPM is known to work on the device: False before it was asked, or when the answer failed."""
        with self._lock:
            return self._support.get(uuid, UNKNOWN) is None

    def _sample(
        self,
        gpu: GpuIdentity,
        physical: Any,
        instance: int | None,
        buffers: _Buffers,
        calls: Calls,
        readings: Sequence[Reading],
    ) -> dict[str, float]:
        nvml = self._nvml
        current = buffers.current
        fields = [reading.field for reading in readings]
        if instance is None:
            filled = calls.call(fields, "nvmlGpmSampleGet", lambda: nvml.nvmlGpmSampleGet(physical, current))
        else:
            filled = calls.call(
                fields, "nvmlGpmMigSampleGet", lambda: nvml.nvmlGpmMigSampleGet(physical, instance, current)
            )
        if filled is None:
            return {}  # the previous sample stays: the next rate spans two intervals, which is still a rate
        if not buffers.has_previous:
            buffers.swap()
            calls.absent(
                fields,
                ReadErrorKind.OTHER,
                f"GPM metrics are rates between two samples, and this is {calls.where}'s first: they are read "
                "from the next tick on",
            )
            return {}
        wanted = [(reading.field, reading.gpm_metric, reading.gpm_scale) for reading in readings]
        if instance is not None:
            wanted.append((GRAPHICS_PERCENT, GPM_GRAPHICS_UTIL, 1.0))
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1 = buffers.previous
        request.sample2 = current
        for position, (_key, metric_id, _scale) in enumerate(wanted):
            request.metrics[position].metricId = metric_id
        answered = calls.call(fields, "nvmlGpmMetricsGet", lambda: nvml.nvmlGpmMetricsGet(request))
        buffers.swap()
        if answered is None:
            return {}
        values: dict[str, float] = {}
        for position, (key, metric_id, scale) in enumerate(wanted):
            metric = request.metrics[position]
            if metric.nvmlReturn == 0:
                values[key] = float(metric.value) * scale
            elif key != GRAPHICS_PERCENT:  # without it, a MIG instance keeps NVML's own utilisation refusal
                calls.failed((key,), f"nvmlGpmMetricsGet[metric {metric_id}]", int(metric.nvmlReturn))
        return values

    def _unsupported(self, gpu: GpuIdentity, physical: Any, calls: Calls, readings: Sequence[Reading]) -> str | None:
        """Why GPM cannot be read on ``gpu`` (asked once per device, of the physical GPU); None when it can.

        A failure that may pass (a timeout) is recorded in ``calls`` for the GPM-only ``readings`` (the others
        have their fallback) and answered with ``UNKNOWN``, uncached.
        """
        with self._lock:
            if gpu.uuid in self._support:
                return self._support[gpu.uuid]
        name = "nvmlGpmQueryDeviceSupport"
        answer, code = calls.attempt(name, lambda: self._nvml.nvmlGpmQueryDeviceSupport(physical))
        if code is not None and code not in _UNSUPPORTED_CODES:
            calls.failed([reading.field for reading in readings if reading.fallback is None], name, code)
            return UNKNOWN
        if code is not None:
            # A driver without GPM at all (FUNCTION_NOT_FOUND), or a device NVML says no for.
            reason = f"{name}({calls.where}): {calls.describe(code)}; {NOT_SUPPORTED_HINT}"
        elif not answer.isSupportedDevice:
            reason = f"GPM is not supported on {calls.where}: {NOT_SUPPORTED_HINT}"
        else:
            reason = None
        with self._lock:
            self._support[gpu.uuid] = reason
        return reason

    def _instance_id(self, gpu: GpuIdentity, handle: Any, calls: Calls, fields: Sequence[str]) -> int | None:
        with self._lock:
            known = self._instance_ids.get(gpu.uuid)
        if known is not None:
            return known
        nvml = self._nvml
        found = calls.call(fields, "nvmlDeviceGetGpuInstanceId", lambda: nvml.nvmlDeviceGetGpuInstanceId(handle))
        if found is None:
            return None
        with self._lock:
            self._instance_ids[gpu.uuid] = int(found)
        return int(found)

    def _buffers_of(self, gpu: GpuIdentity, calls: Calls, fields: Sequence[str]) -> _Buffers | None:
        with self._lock:
            buffers = self._buffers.get(gpu.uuid)
        if buffers is not None:
            return buffers
        first = calls.call(fields, "nvmlGpmSampleAlloc", self._nvml.nvmlGpmSampleAlloc)
        if first is None:
            return None
        second = calls.call(fields, "nvmlGpmSampleAlloc", self._nvml.nvmlGpmSampleAlloc)
        if second is None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlGpmSampleFree(first)
            return None
        buffers = _Buffers(self._nvml, first, second)
        with self._lock:
            # Reads of one device do not overlap (the poll loop skips a device whose read hangs), so nobody
            # else can have put buffers here meanwhile.
            self._buffers[gpu.uuid] = buffers
        return buffers

    def forget(self, uuid: str) -> None:
        """The device was lost: free its samples, and ask about its support again when it is back."""
        with self._lock:
            buffers = self._buffers.pop(uuid, None)
            self._support.pop(uuid, None)
            self._instance_ids.pop(uuid, None)
        if buffers is not None:
            buffers.retire()

    def keep_only(self, uuids: set[str]) -> None:
        """Forget every device not in ``uuids`` (after a new enumeration)."""
        with self._lock:
            gone = [uuid for uuid in set(self._buffers) | set(self._support) if uuid not in uuids]
        for uuid in gone:
            self.forget(uuid)

    def close(self) -> None:
        """Free every device's samples."""
        with self._lock:
            uuids = list(self._buffers)
        for uuid in uuids:
            self.forget(uuid)
