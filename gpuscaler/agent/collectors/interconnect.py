"""PCIe and NVLink traffic per physical GPU: GPM's rates where GPM works, NVML's older calls where it does not.

On Hopper and newer GPM gives all four readings (``gpm.py`` reads them). A GPU without GPM reads PCIe with
``nvmlDeviceGetPcieThroughput`` (KB/s over a 20 ms sample) and NVLink with ``nvmlDeviceGetFieldValues``'
throughput counters (KiB since the driver loaded, over all links), whose rate needs two reads: the reader
keeps each device's previous counters with the monotonic time it read them, as ``gpm.py`` keeps its
previous sample. The first read has no rate, and a counter that went down was reset: both are absent with
their reason, never 0 and never negative.

Either way a GPU without NVLink has no NVLink readings (NOT_SUPPORTED, asked once per device), rather than
a 0 that GPM would report for links that do not exist; and a MIG instance has none of the four, because the
bus and the links belong to the physical GPU.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuscaler.agent.collectors.gpm import Calls
from gpuscaler.model.samples import GpuIdentity, ReadErrorKind

PCIE_TX = "pcie_tx_megabytes_per_second"
PCIE_RX = "pcie_rx_megabytes_per_second"
NVLINK_TX = "nvlink_tx_megabytes_per_second"
NVLINK_RX = "nvlink_rx_megabytes_per_second"
INTERCONNECT_FIELDS: tuple[str, ...] = (PCIE_TX, PCIE_RX, NVLINK_TX, NVLINK_RX)
NVLINK_FIELDS: tuple[str, ...] = (NVLINK_TX, NVLINK_RX)

# NVML_PCIE_UTIL_TX_BYTES and NVML_PCIE_UTIL_RX_BYTES.
_PCIE_COUNTERS = {PCIE_TX: 0, PCIE_RX: 1}
# NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX and _RX, each asked for every link at once (scope UINT_MAX).
_NVLINK_FIELD_IDS = {NVLINK_TX: 138, NVLINK_RX: 139}
ALL_LINKS = 0xFFFFFFFF
# NVML's KB and KiB are 1024 bytes; the readings are in MB/s of 10**6 bytes.
_KIB_IN_MB = 1024 / 1e6

# NVML's NOT_SUPPORTED and FUNCTION_NOT_FOUND (a driver without the call): no NVLink to read, and asking again
# will not change that.
_UNSUPPORTED_CODES = frozenset({3, 13})
_HAS_NVLINK = ""  # the cached answer for a GPU whose NVLink state NVML reports


class InterconnectReader:
    """Reads PCIe and NVLink traffic where GPM does not, and says which devices have none of it.

    ``clock`` is the monotonic clock the NVLink counters' rates are taken in (tests control it).
    """

    def __init__(self, nvml: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml: Any = nvml
        self._clock = clock
        self._lock = threading.Lock()
        self._no_nvlink: dict[str, str] = {}  # uuid -> why it has no NVLink, or _HAS_NVLINK
        self._counters: dict[str, dict[str, tuple[int, float]]] = {}  # uuid -> field -> (KiB, monotonic s)

    def unreadable(self, gpu: GpuIdentity, handle: Any, calls: Calls) -> frozenset[str]:
        """The traffic fields this device has no value for this tick, each with its reason recorded in ``calls``.

        All four on a MIG instance; NVLink's on a GPU without NVLink, or while NVML cannot say whether it has any.
        Neither GPM nor the older calls read them.
        """
        if gpu.mig_parent_uuid is not None:
            calls.absent(
                INTERCONNECT_FIELDS,
                ReadErrorKind.NOT_SUPPORTED,
                "PCIe and NVLink traffic is measured per physical GPU, not per MIG instance",
            )
            return frozenset(INTERCONNECT_FIELDS)
        if self._has_nvlink(gpu, handle, calls):
            return frozenset()
        return frozenset(NVLINK_FIELDS)

    def read(self, gpu: GpuIdentity, handle: Any, calls: Calls, skip: frozenset[str]) -> dict[str, float]:
        """The traffic fields not in ``skip``, in MB/s, from NVML's older calls: for a GPU without GPM."""
        nvml = self._nvml
        values: dict[str, float] = {}
        for field, counter in _PCIE_COUNTERS.items():
            if field in skip:
                continue
            kilobytes = calls.call(
                (field,),
                "nvmlDeviceGetPcieThroughput",
                functools.partial(nvml.nvmlDeviceGetPcieThroughput, handle, counter),
            )
            if kilobytes is not None:
                values[field] = int(kilobytes) * _KIB_IN_MB
        wanted = [field for field in NVLINK_FIELDS if field not in skip]
        if wanted:
            values.update(self._nvlink_rates(gpu, handle, calls, wanted))
        return values

    def _nvlink_rates(self, gpu: GpuIdentity, handle: Any, calls: Calls, wanted: list[str]) -> dict[str, float]:
        nvml = self._nvml
        request = [(_NVLINK_FIELD_IDS[field], ALL_LINKS) for field in wanted]
        answered = calls.call(
            wanted,
            "nvmlDeviceGetFieldValues",
            lambda: nvml.nvmlDeviceGetFieldValues(handle, request),
        )
        if answered is None:
            return {}  # the previous counters stay: the next rate spans two intervals, which is still a rate
        now = self._clock()
        rates: dict[str, float] = {}
        for field, answer in zip(wanted, answered, strict=True):
            name = f"nvmlDeviceGetFieldValues[field {_NVLINK_FIELD_IDS[field]}]"
            code = int(answer.nvmlReturn)
            if code in _UNSUPPORTED_CODES:
                calls.absent(
                    (field,),
                    ReadErrorKind.NOT_SUPPORTED,
                    f"{name}({calls.where}): {calls.describe(code)}: this GPU has no NVLink throughput counters",
                )
            elif code != 0:
                calls.failed((field,), name, code)
            else:
                rate = self._rate(gpu, field, int(answer.value.ullVal), now, name, calls)
                if rate is not None:
                    rates[field] = rate
        return rates

    def _rate(self, gpu: GpuIdentity, field: str, kibibytes: int, now: float, name: str, calls: Calls) -> float | None:
        """MB/s since the previous read of the counter, or None with the reason recorded."""
        with self._lock:
            counters = self._counters.setdefault(gpu.uuid, {})
            previous = counters.get(field)
            if previous is None or now > previous[1]:
                counters[field] = (kibibytes, now)
        if previous is None:
            calls.absent(
                (field,),
                ReadErrorKind.OTHER,
                f"NVLink traffic is the rate of NVML's throughput counter between two reads, and this is "
                f"{calls.where}'s first: it is read from the next tick on",
            )
            return None
        before, then = previous
        if now <= then:
            calls.absent((field,), ReadErrorKind.OTHER, f"{name}({calls.where}): read twice at one instant")
            return None
        if kibibytes < before:
            calls.absent(
                (field,),
                ReadErrorKind.OTHER,
                f"{name}({calls.where}): the NVLink counter went down from {before} to {kibibytes} KiB (a reset): "
                "its rate is read from the next tick on",
            )
            return None
        return (kibibytes - before) * _KIB_IN_MB / (now - then)

    def _has_nvlink(self, gpu: GpuIdentity, handle: Any, calls: Calls) -> bool:
        """Whether the GPU has NVLink (asked once per device); False with the reason recorded when not, or unknown.

        Any answer but NOT_SUPPORTED or FUNCTION_NOT_FOUND means NVLink is there (a link that is down moves 0
        bytes, truly); a failure that may pass is recorded for the NVLink fields and asked again next tick.
        """
        with self._lock:
            known = self._no_nvlink.get(gpu.uuid)
        if known is None:
            nvml = self._nvml
            name = "nvmlDeviceGetNvLinkState"
            _state, code = calls.attempt(name, lambda: nvml.nvmlDeviceGetNvLinkState(handle, 0))
            if code is not None and code not in _UNSUPPORTED_CODES:
                calls.failed(NVLINK_FIELDS, name, code)
                return False
            known = _HAS_NVLINK
            if code is not None:
                known = f"{name}({calls.where}, link 0): {calls.describe(code)}: this GPU has no NVLink"
            with self._lock:
                self._no_nvlink[gpu.uuid] = known
        if known != _HAS_NVLINK:
            calls.absent(NVLINK_FIELDS, ReadErrorKind.NOT_SUPPORTED, known)
            return False
        return True

    def forget(self, uuid: str) -> None:
        """The device was lost: no rate across the loss, and ask about its NVLink again when it is back."""
        with self._lock:
            self._no_nvlink.pop(uuid, None)
            self._counters.pop(uuid, None)

    def keep_only(self, uuids: set[str]) -> None:
        """Forget every device not in ``uuids`` (after a new enumeration)."""
        with self._lock:
            for uuid in (set(self._no_nvlink) | set(self._counters)) - uuids:
                self._no_nvlink.pop(uuid, None)
                self._counters.pop(uuid, None)
